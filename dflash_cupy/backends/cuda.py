"""The CUDA backend: CuPy arrays, NVRTC-compiled ``cupy.RawModule`` kernels,
CuPy streams/events and CUDA graph capture, with the capture rules policed.

Its helpers live beside it: ``signatures`` (kernel entry points, shared with
the emulator), ``launch_limits.launch_config`` (grid/block/shared-memory
checks, shared with the emulator), ``nvrtc_info`` (options, ``#line``, the
include digest, the CUDA header directory from ``cuda_headers``) and
``cuda_pinned`` (page-locked buffers).

Behaviour mirrors ``EmulatedBackend`` (``emu/backend.py``) wherever
the interface says what happens, so code that passes on the emulator runs
here unchanged:

* Kernel arguments are checked against the kernel's C signature (parsed from
  the source by ``signatures.parse_kernels``, as the emulator does):
  pointer parameters take CuPy arrays, scalar parameters take NumPy scalars
  of exactly the parameter's dtype. CuPy itself would silently pass a Python
  ``int`` as a 64-bit value and launch with a wrong argument count; both are
  undefined behaviour on the device, so they raise ``TypeError`` here.
* While a stream is capturing, every launch/copy/event record must name the
  capturing stream, and allocation, host reads, synchronisation, compilation
  and graph launches raise ``CaptureError`` (checked against this backend's
  own flag before touching CUDA).
* ``stream()`` and ``event()`` return thin wrappers (``CudaStream``,
  ``CudaEvent``) whose ``synchronize()`` honours the capture rule; the raw
  CuPy objects are their ``.raw`` attributes. Raw ``cupy.cuda.Stream`` /
  ``ExternalStream`` objects are accepted wherever a stream is taken.
* ``stream=None`` is CuPy's current stream (``current_stream()`` wraps
  ``cupy.cuda.get_current_stream()``; ``with backend_stream:`` enters the raw
  stream's own context). ``zeros`` is ``cupy.zeros`` (a memset on the current
  stream, no device sync) and ``to_numpy(arr, stream=None)`` copies on the
  current (or given) stream and waits for that stream only, like
  ``cupy.ndarray.get()``: the emulator tracks both the same way.

Not shared with the emulator: H2D copies require ``src`` to be a pinned
buffer from ``pinned_empty`` (a pageable source cannot be replayed by a
graph and makes ``cudaMemcpyAsync`` synchronous), and a D2H copy issued
during capture requires a pinned ``dst`` for the same reason.

API facts relied on (CuPy 13/14; confirmed against CuPy's sources/docs):

* ``RawModule(code=, options=<tuple>, backend="nvrtc")`` compiles lazily;
  ``RawModule.compile()`` forces it, raising
  ``cupy.cuda.compiler.CompileException`` whose message is the NVRTC log.
  CuPy appends ``-ftz=true``, its own include dirs and
  ``--device-as-default-execution-space`` and compiles to a cubin for the
  current device's architecture (cupy/cuda/compiler.py).
* ``RawKernel.__call__(grid: tuple, block: tuple, args, shared_mem=,
  stream=)`` forwards to ``Function.__call__``; ``stream=None`` means the
  current stream. CuPy clamps every grid/block dimension to >= 1, so a zero
  grid would launch one block; ``_dim3`` rejects it first.
* ``RawKernel.max_dynamic_shared_size_bytes`` is a setter for
  ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` (the driver-API name of
  ``cudaFuncAttributeMaxDynamicSharedMemorySize``), needed above 48 KiB.
* ``cupy.cuda.runtime.memcpyAsync(dst, src, size, kind, stream_ptr)`` is a
  plain ``cudaMemcpyAsync``; stream capture records it as a memcpy node
  (CUDA Programming Guide, "Creating a Graph Using Stream Capture"), unlike
  CuPy's higher-level transfers: ``Stream.begin_capture``'s docstring says
  synchronous device-host transfers raise during capture.
* ``Stream.begin_capture(mode=None)`` uses ``cudaStreamCaptureModeRelaxed``
  and refuses the legacy default stream; ``Stream.end_capture()`` returns an
  instantiated ``cupy.cuda.Graph`` whose ``launch(stream=None)`` runs on the
  given (or current) stream (cupy/cuda/stream.pyx, cupy/cuda/graph.pyx).
* ``cupyx.empty_pinned`` allocates through ``cupy.cuda.alloc_pinned_memory``
  (the pinned pool), so the capture guard below also refuses it;
  ``set_pinned_memory_allocator`` has no getter, so the guard restores
  CuPy's default pinned pool allocator.
* ``cupy.cuda.set_allocator`` raises inside a ``using_allocator`` block and
  is process-global, so the capture guard uses the thread-local
  ``cupy.cuda.using_allocator`` context (entered at ``begin_capture``, left
  at ``end_capture``) which takes precedence over the global allocator.
"""
from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np

import cupy
from cupy.cuda import driver as _driver
from cupy.cuda import runtime as _runtime

from .. import device_props
from . import cuda_launch_ex, cuda_pinned, launch_limits, nvrtc_info, signatures
from .base import (Backend, BackendError, CaptureError, Graph, Kernel, KernelLaunchError, Module,
                   check_kernel_args, copy_nbytes, notify_launch, resolve_pdl)
from .cuda_pinned import host_ptr as _host_ptr

NVRTC_FLAGS = nvrtc_info.NVRTC_FLAGS  # ("--std=c++17", "-ftz=true")

_DEFAULT_SMEM = device_props.DEFAULT_SMEM  # dynamic shared memory allowed without the opt-in attribute
_DEFAULT_STREAM_PTRS = (0, 1, 2)  # legacy NULL, cudaStreamLegacy, cudaStreamPerThread
# Raw CuPy stream classes accepted where a stream is taken (ExternalStream is deprecated in
# CuPy 14 and may go; the base class name differs between versions).
_RAW_STREAM_TYPES = tuple(t for t in (cupy.cuda.Stream, getattr(cupy.cuda, "ExternalStream", None),
                                      getattr(cupy.cuda.stream, "_BaseStream", None),
                                      getattr(cupy.cuda.stream, "BaseStream", None))
                          if isinstance(t, type))


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def _check_dtype_supported(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind == "V" or dt.name == "bfloat16":
        raise TypeError(f"dtype {dt} cannot live in a CuPy array; store bf16 as np.uint16 bit patterns "
                        "(x.astype(ml_dtypes.bfloat16).view(np.uint16))")
    return dt


# ---------------------------------------------------------------------------
# streams, events, graphs
# ---------------------------------------------------------------------------
class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _host_wait(backend, raw, what: str) -> None:
    """``raw.synchronize()`` (a CuPy stream or event), refused during capture;
    a device error surfaces as KernelLaunchError."""
    backend._no_capture(f"{what.split()[-1]}.synchronize()")
    try:
        raw.synchronize()
    except _runtime.CUDARuntimeError as e:
        raise KernelLaunchError(f"device error while synchronising {what} "
                                f"(an earlier kernel failed?): {e}") from e


class CudaStream:
    """A CuPy stream (``.raw``) whose ``synchronize()`` refuses during capture;
    ``with s:`` makes it CuPy's current stream inside the block (``raw``'s
    own context manager). Two wrappers of one CUDA stream compare equal."""

    def __init__(self, backend: "CudaBackend", raw):
        self._backend = backend
        self.raw = raw

    def __eq__(self, other) -> bool:
        return isinstance(other, CudaStream) and other.ptr == self.ptr

    def __hash__(self) -> int:
        return hash(self.ptr)

    def __enter__(self) -> "CudaStream":
        self.raw.__enter__()
        return self

    def __exit__(self, *exc):
        return self.raw.__exit__(*exc)

    @property
    def ptr(self) -> int:
        return self.raw.ptr

    def synchronize(self) -> None:
        _host_wait(self._backend, self.raw, "a stream")

    def is_capturing(self) -> bool:
        return self._backend._capture_raw is not None and self._backend._capture_raw.ptr == self.ptr

    def wait_event(self, event: "CudaEvent") -> None:
        """Later work on this stream waits (on the device) for ``event``."""
        self.raw.wait_event(event.raw if isinstance(event, CudaEvent) else event)
        self._backend._cap_follows_kernel = False

    def __repr__(self) -> str:
        return f"<CudaStream 0x{self.ptr:x}>"


class CudaEvent:
    """A CuPy event (``.raw``) with ``record(stream)``, ``synchronize()`` and ``query()``."""

    def __init__(self, backend: "CudaBackend"):
        self._backend = backend
        self.raw = cupy.cuda.Event()

    def record(self, stream=None) -> None:
        raw = self._backend._stream_for(stream, "event.record()")
        self.raw.record(raw)
        self._backend._cap_follows_kernel = False   # (a captured record: no programmatic edge across it)

    def synchronize(self) -> None:
        _host_wait(self._backend, self.raw, "an event")

    def query(self) -> bool:
        try:
            return bool(self.raw.done)
        except _runtime.CUDARuntimeError as e:
            if self._backend.is_capturing():
                raise CaptureError(f"event.query() failed while a stream is capturing: {e}") from e
            raise KernelLaunchError(f"device error while querying an event: {e}") from e


class CudaGraph(Graph):
    """An instantiated CUDA graph (``.raw`` is the ``cupy.cuda.Graph``)."""

    def __init__(self, backend: "CudaBackend", raw, n_launches: int, n_copies: int):
        self._backend = backend
        self.raw = raw
        self.n_launches = n_launches
        self.n_copies = n_copies

    def launch(self, stream=None) -> None:
        self._backend._no_capture("graph.launch()")
        raw = self._backend._stream_for(stream, "graph.launch()")
        try:
            self.raw.launch(stream=raw)
        except _runtime.CUDARuntimeError as e:
            raise KernelLaunchError(f"graph launch failed: {e}") from e


# ---------------------------------------------------------------------------
# modules and kernels
# ---------------------------------------------------------------------------
class CudaKernel(Kernel):
    def __init__(self, module: "CudaModule", raw, sig: signatures.KernelSig):
        self._module = module
        self._raw = raw
        self.sig = sig
        self.name = sig.name
        self._smem_attr = _DEFAULT_SMEM  # dynamic shared memory currently allowed by the attribute

    @property
    def raw(self):
        """The ``cupy.RawKernel`` (for attributes such as ``num_regs``)."""
        return self._raw

    def _check_args(self, args: Sequence[Any]) -> tuple:
        check_kernel_args(self.name, self.sig.params, args, cupy.ndarray,
                          lambda a: " (a host NumPy array; copy it to the device first)"
                          if isinstance(a, np.ndarray) else "")
        # a struct goes as its bytes (a NumPy aligned structured scalar), pointers as addresses
        return tuple(signatures.pack_struct(p, a, lambda v: int(v.data.ptr)) if p.is_struct else a
                     for p, a in zip(self.sig.params, args))

    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0, stream=None,
                 pdl: bool | None = None) -> None:
        be = self._module.backend
        pdl = resolve_pdl(pdl, be._capture_raw is not None and be._cap_follows_kernel, self.name)
        g, b, shared_mem = launch_limits.launch_config(self.name, grid, block, shared_mem)
        limit = be._smem_optin()  # this device's, not sm_90's: checked here, not in launch_limits
        if shared_mem > limit:
            raise ValueError(f"kernel {self.name}: shared_mem={shared_mem} outside [0, {limit}]")
        packed = self._check_args(args)
        raw_stream = be._stream_for(stream, f"kernel {self.name}")
        if shared_mem > self._smem_attr:
            # Needed above 48 KiB. A function attribute, not stream work; normally first set by an
            # eager launch (cuFuncSetAttribute inside a relaxed-mode capture is not documented as
            # refused, but is untested here).
            try:
                self._raw.max_dynamic_shared_size_bytes = shared_mem
            except (_driver.CUDADriverError, _runtime.CUDARuntimeError) as e:
                during = " (during capture: launch it once before capturing)" if be.is_capturing() else ""
                raise KernelLaunchError(f"kernel {self.name}: cannot allow shared_mem={shared_mem} "
                                        f"bytes of dynamic shared memory{during}: {e}") from e
            self._smem_attr = shared_mem
        try:
            if pdl:
                # CuPy's launch cannot carry attributes: the same CUfunction through cuLaunchKernelEx
                cuda_launch_ex.launch(self._raw.kernel.ptr, g, b, shared_mem, be._stream_ptr(raw_stream),
                                      self.sig.params, packed)
            else:
                self._raw(g, b, packed, shared_mem=shared_mem, stream=raw_stream)
        except (_driver.CUDADriverError, _runtime.CUDARuntimeError, cuda_launch_ex.LaunchExError) as e:
            how = " (programmatic)" if pdl else ""
            raise KernelLaunchError(f"kernel {self.name}: launch{how} grid={g} block={b} "
                                    f"shared_mem={shared_mem} failed: {e}") from e
        if be._capture_raw is not None:
            be._captured_launches += 1
            be._cap_follows_kernel = True
            if pdl:
                be._captured_pdl += 1
        notify_launch("kernel", self.name, signatures.by_name(self.sig.params, args), stream)


class CudaModule(Module):
    def __init__(self, backend: "CudaBackend", raw_module, sigs: list[signatures.KernelSig],
                 filename: str):
        self.backend = backend
        self.raw = raw_module
        self.filename = filename
        self._sigs = {s.name: s for s in sigs}
        self._kernels: dict[str, CudaKernel] = {}

    def get_function(self, name: str) -> CudaKernel:
        k = self._kernels.get(name)
        if k is not None:
            return k
        sig = self._sigs.get(name)
        if sig is None:
            raise BackendError(f"no extern \"C\" __global__ function {name!r} in module {self.filename} "
                               f"(has: {', '.join(self._sigs) or 'none'})")
        try:
            raw = self.raw.get_function(name)  # loads the function now (CUDA_ERROR_NOT_FOUND if absent)
        except (_driver.CUDADriverError, _runtime.CUDARuntimeError) as e:
            raise BackendError(f"kernel {name!r} of {self.filename} could not be loaded: {e}") from e
        k = CudaKernel(self, raw, sig)
        self._kernels[name] = k
        return k


# ---------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------
def _deny_device_alloc(size):
    raise CaptureError(f"device allocation during capture ({size} bytes): allocate every buffer "
                       "before begin_capture (a captured graph must not depend on pool addresses)")


_capture_tls = threading.local()   # .capturing: this thread is capturing (any CudaBackend)
_pinned_guard_lock = threading.Lock()
_pinned_guard_users = 0


def _deny_pinned_alloc(size):
    """The pinned allocator while some thread captures: refuses the capturing
    thread only (set_pinned_memory_allocator is process-wide)."""
    if getattr(_capture_tls, "capturing", False):
        raise CaptureError(f"pinned host allocation during capture ({size} bytes): CuPy stages host "
                           "transfers through pinned memory, which cannot be captured; allocate "
                           "pinned buffers with pinned_empty() before begin_capture")
    return cupy.get_default_pinned_memory_pool().malloc(size)


def _pinned_guard(on: bool) -> None:
    global _pinned_guard_users
    with _pinned_guard_lock:
        _pinned_guard_users += 1 if on else -1
        if on and _pinned_guard_users == 1:
            cupy.cuda.set_pinned_memory_allocator(_deny_pinned_alloc)
        elif not on and _pinned_guard_users == 0:
            cupy.cuda.set_pinned_memory_allocator(cupy.get_default_pinned_memory_pool().malloc)


def _check_stream_device(raw) -> None:
    """ValueError for a stream of another device (its context is not the current one)."""
    if raw.ptr in _DEFAULT_STREAM_PTRS:
        return
    try:
        ctx, cur = _driver.streamGetCtx(raw.ptr), _driver.ctxGetCurrent()
    except (_driver.CUDADriverError, AttributeError):
        return  # cannot tell here: CUDA reports a foreign stream at the launch
    if ctx != cur:
        raise ValueError(f"stream {raw!r} belongs to another device (context {ctx:#x}; this module runs on "
                         f"device {_runtime.getDevice()}, context {cur:#x})")


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self):
        # Nothing here touches the device, so the class can be built (and its interface checked)
        # on a machine without a GPU.
        self._tls = threading.local()     # capture state is per thread (relaxed-mode captures)
        self._smem_limit: int | None = None

    # ---- capture plumbing: per thread, so one thread capturing a graph does not stop
    # another thread's unrelated work (the capture itself is relaxed mode) ----
    def _tls_get(self, name, default=None):
        return getattr(self._tls, name, default)

    _capture_raw = property(lambda self: self._tls_get("capture_raw"),
                            lambda self, v: setattr(self._tls, "capture_raw", v))
    _alloc_guard = property(lambda self: self._tls_get("alloc_guard"),
                            lambda self, v: setattr(self._tls, "alloc_guard", v))
    _captured_launches = property(lambda self: self._tls_get("launches", 0),
                                  lambda self, v: setattr(self._tls, "launches", v))
    _captured_copies = property(lambda self: self._tls_get("copies", 0),
                                lambda self, v: setattr(self._tls, "copies", v))
    _captured_pdl = property(lambda self: self._tls_get("pdl", 0),
                             lambda self, v: setattr(self._tls, "pdl", v))
    # the capture's latest node is a kernel launch (a programmatic launch may follow it)
    _cap_follows_kernel = property(lambda self: self._tls_get("follows_kernel", False),
                                   lambda self, v: setattr(self._tls, "follows_kernel", v))

    def _no_capture(self, what: str) -> None:
        if self._capture_raw is not None:
            raise CaptureError(f"{what} is not allowed while a stream is capturing "
                               f"(it would not be recorded into the graph)")

    @staticmethod
    def _raw_stream(stream):
        if stream is None:
            return None
        if isinstance(stream, CudaStream):
            return stream.raw
        if isinstance(stream, _RAW_STREAM_TYPES):
            return stream
        raise TypeError(f"stream must be a stream from backend.stream(), a cupy.cuda.Stream or None, "
                        f"got {type(stream).__name__}")

    def _stream_for(self, stream, what: str):
        """The raw CuPy stream to issue work on (None: CuPy's current stream,
        which may be the capturing one inside ``with stream:``)."""
        raw = self._raw_stream(stream)
        cap = self._capture_raw
        if cap is not None and (raw if raw is not None else cupy.cuda.get_current_stream()).ptr != cap.ptr:
            raise CaptureError(f"{what}: work was issued to another stream (or the default stream) while "
                               "a stream is capturing; issue it to the capturing stream")
        return raw

    @staticmethod
    def _stream_ptr(raw) -> int:
        return int((raw if raw is not None else cupy.cuda.get_current_stream()).ptr)

    def _smem_optin(self) -> int:
        if self._smem_limit is None:
            self._smem_limit = device_props.query_cupy().smem_optin
        return self._smem_limit

    # ---- arrays -----------------------------------------------------------
    def empty(self, shape, dtype):
        self._no_capture("allocation (empty)")
        return cupy.empty(shape, _check_dtype_supported(dtype))

    def zeros(self, shape, dtype):
        """``cupy.zeros``: the memset is work on the current stream (the emulator
        tracks it the same way), so users on another stream must order after it."""
        self._no_capture("allocation (zeros)")
        return cupy.zeros(shape, _check_dtype_supported(dtype))

    def asarray(self, host):
        self._no_capture("allocation (asarray)")
        if isinstance(host, cupy.ndarray):
            a = host.copy()
            _runtime.deviceSynchronize()
            return a
        host = np.asarray(host)
        if not host.flags.c_contiguous:  # (np.ascontiguousarray would turn 0-d into 1-d)
            host = np.array(host, order="C")
        a = cupy.empty(host.shape, _check_dtype_supported(host.dtype))
        if host.nbytes:
            # Synchronous cudaMemcpy plus a device sync: the copy is complete for every stream
            # when this returns (CuPy's asarray would copy asynchronously on the current stream).
            _runtime.memcpy(a.data.ptr, _host_ptr(host), host.nbytes, _runtime.memcpyHostToDevice)
            _runtime.deviceSynchronize()
        return a

    def to_numpy(self, arr, stream=None) -> np.ndarray:
        self._no_capture("to_numpy (a device-to-host read)")
        if isinstance(arr, np.ndarray):
            return np.array(arr, copy=True)
        if not isinstance(arr, cupy.ndarray):
            raise TypeError(f"arr must be a CuPy device array, got {type(arr).__name__}")
        raw = self._stream_for(stream, "to_numpy")
        ptr = self._stream_ptr(raw)
        with (raw if raw is not None else _NullContext()):  # ascontiguousarray runs on it too
            src = arr if arr.flags.c_contiguous else cupy.ascontiguousarray(arr)
        out = np.empty(arr.shape, arr.dtype)
        try:
            # In order on the stream, then a wait for that stream only (cupy.ndarray.get()).
            if out.nbytes:
                _runtime.memcpyAsync(_host_ptr(out), src.data.ptr, out.nbytes,
                                     _runtime.memcpyDeviceToHost, ptr)
            _runtime.streamSynchronize(ptr)
        except _runtime.CUDARuntimeError as e:
            raise KernelLaunchError(f"device error while reading an array (an earlier kernel "
                                    f"failed?): {e}") from e
        return out

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        self._no_capture("allocation (pinned_empty)")
        return cuda_pinned.pinned_empty(shape, dtype)

    def is_pinned(self, a: np.ndarray) -> bool:
        """True if ``a``'s bytes are page-locked host memory (``cuda_pinned.is_pinned``)."""
        return cuda_pinned.is_pinned(a)

    def is_device_array(self, x) -> bool:
        return isinstance(x, cupy.ndarray)

    # ---- code -------------------------------------------------------------
    def compile(self, source: str, options: Sequence[str] = (), filename: str | None = None) -> CudaModule:
        self._no_capture("compile")
        fname = filename or "<source>.cu"
        try:
            sigs = signatures.parse_kernels(source)
        except ValueError as e:
            raise BackendError(f"{fname}: {e}") from None
        opts = (NVRTC_FLAGS + nvrtc_info.normalise_options(options)
                + tuple("-I" + d for d in nvrtc_info.cuda_header_dirs()))
        code = nvrtc_info.with_line_directive(source, fname) + nvrtc_info.cache_tag(source, fname, opts)
        try:
            raw = cupy.RawModule(code=code, options=opts, backend="nvrtc")
            raw.compile()  # eager: errors surface here, not at the first launch
        except cupy.cuda.compiler.CompileException as e:
            raise BackendError(f"NVRTC failed to compile {fname}:\n{e}\n"
                               f"(options: {' '.join(opts)})") from None
        except Exception as e:  # CUDA root not found, cubin load failure, ...
            raise BackendError(f"compiling {fname} for CUDA failed: {type(e).__name__}: {e}") from e
        return CudaModule(self, raw, sigs, fname)

    # ---- streams, events, copies -------------------------------------------
    def stream(self) -> CudaStream:
        return CudaStream(self, cupy.cuda.Stream(non_blocking=True))

    def current_stream(self) -> CudaStream:
        return CudaStream(self, cupy.cuda.get_current_stream())

    def as_stream(self, stream) -> CudaStream:
        if isinstance(stream, CudaStream):
            _check_stream_device(stream.raw)
            return stream
        raw = self._raw_stream(stream)
        if raw is not None:
            _check_stream_device(raw)
        return CudaStream(self, raw if raw is not None else cupy.cuda.get_current_stream())

    def event(self) -> CudaEvent:
        return CudaEvent(self)

    def _memcpy(self, dst_ptr: int, src_ptr: int, n: int, kind: int, raw_stream, what: str) -> None:
        if n == 0:
            return
        try:
            _runtime.memcpyAsync(dst_ptr, src_ptr, n, kind, self._stream_ptr(raw_stream))
        except _runtime.CUDARuntimeError as e:
            if self._capture_raw is not None:
                raise CaptureError(f"{what}: cudaMemcpyAsync refused during capture: {e}") from e
            raise BackendError(f"{what}: cudaMemcpyAsync failed: {e}") from e
        if self._capture_raw is not None:
            self._captured_copies += 1
            self._cap_follows_kernel = False

    def copy_h2d_async(self, dst, src: np.ndarray, stream=None, nbytes: int | None = None) -> None:
        what = "copy_h2d_async"
        if not isinstance(dst, cupy.ndarray):
            raise TypeError(f"{what}: dst must be a CuPy device array, got {type(dst).__name__}")
        if not isinstance(src, np.ndarray):
            raise TypeError(f"{what}: src must be a pinned NumPy array from pinned_empty(), "
                            f"got {type(src).__name__}")
        n = copy_nbytes(dst, src, nbytes, what)
        if src.nbytes and not self.is_pinned(src):
            raise ValueError(f"{what}: src is not pinned host memory; allocate it with "
                             "backend.pinned_empty() (the copy reads it when it executes, "
                             "which for a captured copy is at graph replay)")
        raw = self._stream_for(stream, what)
        self._memcpy(dst.data.ptr, _host_ptr(src), n, _runtime.memcpyHostToDevice, raw, what)
        notify_launch("copy", "h2d", (dst, src), stream)

    def copy_d2h_async(self, dst: np.ndarray, src, stream=None, nbytes: int | None = None) -> None:
        what = "copy_d2h_async"
        if not isinstance(dst, np.ndarray):
            raise TypeError(f"{what}: dst must be a NumPy array, got {type(dst).__name__}")
        if not isinstance(src, cupy.ndarray):
            raise TypeError(f"{what}: src must be a CuPy device array, got {type(src).__name__}")
        if not dst.flags.writeable:
            raise ValueError(f"{what}: dst is read-only")
        n = copy_nbytes(dst, src, nbytes, what)
        if self._capture_raw is not None and dst.nbytes and not self.is_pinned(dst):
            raise ValueError(f"{what}: during capture dst must be pinned host memory from "
                             "backend.pinned_empty() (the graph writes it at replay)")
        raw = self._stream_for(stream, what)
        self._memcpy(_host_ptr(dst), src.data.ptr, n, _runtime.memcpyDeviceToHost, raw, what)
        notify_launch("copy", "d2h", (dst, src), stream)

    def copy_d2d_async(self, dst, src, stream=None, nbytes: int | None = None) -> None:
        what = "copy_d2d_async"
        for name, a in (("dst", dst), ("src", src)):
            if not isinstance(a, cupy.ndarray):
                raise TypeError(f"{what}: {name} must be a CuPy device array, got {type(a).__name__}")
        n = copy_nbytes(dst, src, nbytes, what)
        d0, s0 = int(dst.data.ptr), int(src.data.ptr)
        if n and d0 != s0 and d0 < s0 + n and s0 < d0 + n:
            # cudaMemcpyAsync on overlapping ranges is undefined; fail loudly instead.
            raise ValueError(f"{what}: dst and src overlap ({n} bytes at 0x{d0:x} and 0x{s0:x})")
        raw = self._stream_for(stream, what)
        self._memcpy(d0, s0, n, _runtime.memcpyDeviceToDevice, raw, what)
        notify_launch("copy", "d2d", (dst, src), stream)

    def synchronize(self) -> None:
        self._no_capture("synchronize()")
        try:
            _runtime.deviceSynchronize()
        except _runtime.CUDARuntimeError as e:
            raise KernelLaunchError(f"device error while synchronising (an earlier kernel failed?): "
                                    f"{e}") from e

    # ---- capture ----------------------------------------------------------
    def begin_capture(self, stream) -> None:
        if self._capture_raw is not None:
            raise CaptureError("a stream is already capturing")
        try:
            raw = self._raw_stream(stream)
        except TypeError:
            raw = None
        if raw is None or raw.ptr in _DEFAULT_STREAM_PTRS:
            raise CaptureError("capture needs a stream from backend.stream() (not the default stream)")
        guard = cupy.cuda.using_allocator(_deny_device_alloc)  # thread-local in CuPy
        guard.__enter__()
        _capture_tls.capturing = True
        _pinned_guard(True)
        try:
            raw.begin_capture()
        except BaseException as e:
            self._restore_allocators(guard)
            if isinstance(e, Exception):
                raise CaptureError(f"cudaStreamBeginCapture failed: {e}") from e
            raise
        self._alloc_guard = guard
        self._capture_raw = raw
        self._captured_launches = 0
        self._captured_copies = 0
        self._captured_pdl = 0
        self._cap_follows_kernel = False

    def _restore_allocators(self, guard) -> None:
        _capture_tls.capturing = False
        _pinned_guard(False)
        guard.__exit__(None, None, None)

    def end_capture(self, stream) -> CudaGraph:
        cap = self._capture_raw
        try:
            raw = self._raw_stream(stream)
        except TypeError:
            raw = None
        if cap is None or raw is None or raw.ptr != cap.ptr:
            raise CaptureError("end_capture on a stream that is not capturing")
        guard = self._alloc_guard
        self._capture_raw = None
        self._alloc_guard = None
        try:
            g = cap.end_capture()
        except Exception as e:
            # e.g. cudaErrorStreamCaptureInvalidated after an operation capture could not record
            raise CaptureError(f"capture failed at end_capture: {e}") from e
        finally:
            self._restore_allocators(guard)
        graph = CudaGraph(self, g, self._captured_launches, self._captured_copies)
        graph.n_pdl = self._captured_pdl
        return graph

    def is_capturing(self) -> bool:
        return self._capture_raw is not None

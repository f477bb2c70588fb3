"""The emulated backend: the same ``cuda_src/*.cu`` run on the CPU.

Device arrays are NumPy arrays in guarded memory (``emu_memory``); kernels
are compiled by g++ against ``cuda_src/emu/cuda_emu.h`` (``emu_build``) and
run synchronously at launch. Streams order nothing (everything is already in
order); capture records launches and copies on the capturing stream and
``Graph.launch`` replays them, reading pinned host buffers at replay time as
a CUDA graph does.

Debug aids (on by default, so tests always have them): fibers are scheduled
in a seeded shuffled order between barriers, shared memory is poisoned with
NaN before every block, and array overruns hit guard pages. Settings:
``DFLASH_CUPY_EMU_SCHEDULE=shuffle|forward|reverse``,
``DFLASH_CUPY_EMU_SEED`` and ``DFLASH_CUPY_EMU_THREADS`` (OS threads that
run blocks of one launch; default min(4, cores)).
"""
from __future__ import annotations

import ctypes
import os
import signal
import threading
from typing import Any, Sequence

import numpy as np

from . import emu_build, emu_memory
from .base import (Backend, BackendError, CaptureError, Graph, Kernel, KernelLaunchError, Module,
                   copy_nbytes)
from .base import check_kernel_args
from .base import dim3 as _dim3

_ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
_ERRLEN = 1024
_SIGNAMES = {signal.SIGSEGV: "invalid memory access (SIGSEGV)", signal.SIGBUS: "bus error (SIGBUS)",
             signal.SIGFPE: "arithmetic fault (SIGFPE, e.g. integer division by zero)"}


class EmuStream:
    """A stream of the emulated backend. Work runs at once unless capturing."""

    def __init__(self, backend: "EmulatedBackend"):
        self._backend = backend
        self._record: list | None = None
        self.ptr = id(self)

    def synchronize(self) -> None:
        self._backend._no_capture("stream.synchronize()")

    def is_capturing(self) -> bool:
        return self._record is not None

    def wait_event(self, event) -> None:
        """Work runs in issue order here: nothing to wait for."""


class EmuEvent:
    def __init__(self, backend: "EmulatedBackend"):
        self._backend = backend

    def record(self, stream: EmuStream | None = None) -> None:
        rec = self._backend._recording(stream)
        if rec is not None:
            rec.append(("event", None))

    def synchronize(self) -> None:
        self._backend._no_capture("event.synchronize()")

    def query(self) -> bool:
        return True


class EmuGraph(Graph):
    def __init__(self, backend: "EmulatedBackend", ops: list):
        self._backend = backend
        self._ops = ops
        self.n_launches = sum(1 for op in ops if op[0] == "launch")
        self.n_copies = sum(1 for op in ops if op[0] == "copy")

    def launch(self, stream: EmuStream | None = None) -> None:
        self._backend._no_capture("graph.launch()")
        for kind, payload in self._ops:
            if kind == "launch":
                kernel, launch_args = payload
                kernel._run(*launch_args)
            elif kind == "copy":
                dst, src, n = payload
                ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)


class EmuKernel(Kernel):
    def __init__(self, module: "EmuModule", index: int, sig: emu_build.KernelSig):
        self._module = module
        self._index = index
        self.sig = sig
        self.name = sig.name

    def _pack(self, args: Sequence[Any]):
        check_kernel_args(self.name, self.sig.params, args, np.ndarray)
        keep, slots = [], []
        for p, a in zip(self.sig.params, args):
            if p.is_pointer:
                keep.append(a)
                slots.append(ctypes.c_void_p(a.ctypes.data))
            else:
                slots.append(ctypes.create_string_buffer(a.tobytes(), max(a.dtype.itemsize, 8)))
        ptrs = (ctypes.c_void_p * max(1, len(slots)))()
        for i, s in enumerate(slots):
            ptrs[i] = ctypes.addressof(s)
        # keep[2]: the allocations the pointers point into (cuda_emu.h checks accesses against them)
        return ptrs, (keep, slots, emu_memory.launch_ranges(self.sig.params, args))

    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0,
                 stream: EmuStream | None = None) -> None:
        g, b = _dim3(grid, f"kernel {self.name}: grid"), _dim3(block, f"kernel {self.name}: block")
        nthreads = b[0] * b[1] * b[2]
        if nthreads > 1024:
            raise ValueError(f"kernel {self.name}: block {b} has {nthreads} threads (max 1024)")
        shared_mem = int(shared_mem)
        if not 0 <= shared_mem <= emu_build.SMEM_BYTES:
            raise ValueError(f"kernel {self.name}: shared_mem={shared_mem} outside [0, {emu_build.SMEM_BYTES}]")
        ptrs, keep = self._pack(args)
        backend = self._module.backend
        rec = backend._recording(stream)
        if rec is not None:
            rec.append(("launch", (self, (g, b, ptrs, keep, shared_mem))))
            return
        self._run(g, b, ptrs, keep, shared_mem)

    def _run(self, g, b, ptrs, keep, shared_mem) -> None:
        backend = self._module.backend
        grid = (ctypes.c_uint * 3)(*g)
        block = (ctypes.c_uint * 3)(*b)
        seed = backend._next_seed()
        nblocks = g[0] * g[1] * g[2]
        # Worker threads pay off only when there is enough work to share.
        workers = min(backend.threads, nblocks) if nblocks * b[0] * b[1] * b[2] >= 4096 else 1

        nthreads = b[0] * b[1] * b[2]

        def part(first: int):
            err = ctypes.create_string_buffer(_ERRLEN)
            fault_addr, fault_sig = ctypes.c_void_p(), ctypes.c_int()
            arena = emu_memory.stack_arena(nthreads)  # this OS thread's fiber stacks
            rc = self._module._launch(self._index, ptrs, grid, block, shared_mem, seed, backend.order,
                                      first, workers, arena.base, arena.count, arena.stride, *keep[2],
                                      err, _ERRLEN, ctypes.byref(fault_addr), ctypes.byref(fault_sig))
            return rc, err.value.decode(errors="replace"), fault_addr.value, fault_sig.value

        if workers == 1:
            results = [part(0)]
        else:
            results = list(backend._pool().map(part, range(workers)))
        for rc, where, addr, sig in results:
            if rc == 2:
                what = _SIGNAMES.get(sig, f"signal {sig}")
                raise KernelLaunchError(f"kernel {self.name}: {what} {emu_memory.describe_address(addr)} "
                                        f"in {where}")
            if rc:
                raise KernelLaunchError(f"kernel {self.name}: {where}")


class EmuModule(Module):
    def __init__(self, backend: "EmulatedBackend", so_path, kernels):
        self.backend = backend
        try:
            self._lib = ctypes.CDLL(str(so_path))
        except OSError as e:
            raise BackendError(f"cannot load the emulated module {so_path}: {e}") from None
        f = self._lib.emu_launch
        f.restype = ctypes.c_int
        f.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint,
                      ctypes.c_ulonglong, ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong,
                      ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong,
                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # allocations of the pointer args
                      ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
        self._launch = f
        emu_build.load_static_shared(self._lib, so_path)
        self._kernels = {k.name: EmuKernel(self, i, k) for i, k in enumerate(kernels)}

    def get_function(self, name: str) -> EmuKernel:
        try:
            return self._kernels[name]
        except KeyError:
            raise BackendError(f"no extern \"C\" __global__ function {name!r} in module "
                               f"(has: {', '.join(self._kernels) or 'none'})") from None


class EmulatedBackend(Backend):
    name = "emulated"

    def __init__(self):
        sched = os.environ.get("DFLASH_CUPY_EMU_SCHEDULE", "shuffle").strip().lower()
        if sched not in _ORDERS:
            raise ValueError(f"DFLASH_CUPY_EMU_SCHEDULE={sched!r}: expected one of {tuple(_ORDERS)}")
        self.schedule = sched
        self.seed = int(os.environ.get("DFLASH_CUPY_EMU_SEED", "12345"))
        self.threads = max(1, int(os.environ.get("DFLASH_CUPY_EMU_THREADS",
                                                 min(4, os.cpu_count() or 1))))
        self._launch_count = 0
        self._capturing: EmuStream | None = None
        self._lock = threading.Lock()
        self._executor = None

    def _pool(self):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="dflash-emu")
        return self._executor

    # ---- debug settings
    @property
    def order(self) -> int:
        return _ORDERS[self.schedule]

    def _next_seed(self) -> int:
        with self._lock:
            self._launch_count += 1
            return (self.seed * 0x100000001B3 + self._launch_count) & 0xFFFFFFFFFFFFFFFF

    # ---- capture plumbing
    def _no_capture(self, what: str) -> None:
        if self._capturing is not None:
            raise CaptureError(f"{what} is not allowed while a stream is capturing "
                               f"(it would not be recorded into the graph)")

    def _recording(self, stream):
        cap = self._capturing
        if cap is None:
            if stream is not None and not isinstance(stream, EmuStream):
                raise TypeError(f"stream must be an emulated stream or None, got {type(stream).__name__}")
            return None
        if stream is not cap:
            raise CaptureError("work was issued to another stream (or the default stream) while a stream "
                               "is capturing; issue it to the capturing stream")
        return cap._record

    # ---- arrays
    def empty(self, shape, dtype):
        self._no_capture("allocation (empty)")
        a = emu_memory.guarded_empty(shape, dtype, "device array")
        if a.nbytes and emu_memory.poison_enabled():
            a.reshape(-1).view(np.uint8).fill(0xFF)  # NaN / -1: reads of unwritten memory show
        return a

    def zeros(self, shape, dtype):
        self._no_capture("allocation (zeros)")
        a = emu_memory.guarded_empty(shape, dtype, "device array")
        a.fill(0)
        return a

    def asarray(self, host):
        self._no_capture("allocation (asarray)")
        host = np.asarray(host)
        a = emu_memory.guarded_empty(host.shape, host.dtype, "device array")
        a[...] = host
        return a

    def to_numpy(self, arr) -> np.ndarray:
        self._no_capture("to_numpy (a device-to-host read)")
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"arr must be an emulated device array, got {type(arr).__name__}")
        return np.array(arr, copy=True)

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        self._no_capture("allocation (pinned_empty)")
        return emu_memory.guarded_empty(shape, dtype, "pinned host array")

    def is_device_array(self, x) -> bool:
        return isinstance(x, np.ndarray)

    # ---- code
    def compile(self, source: str, options: Sequence[str] = (), filename: str | None = None) -> EmuModule:
        self._no_capture("compile")
        try:
            so, kernels = emu_build.build(source, options, filename)
        except (emu_build.CompileError, ValueError) as e:
            raise BackendError(str(e)) from None
        return EmuModule(self, so, kernels)

    # ---- streams, events, copies
    def stream(self) -> EmuStream:
        return EmuStream(self)

    def event(self) -> EmuEvent:
        return EmuEvent(self)

    def _copy(self, dst, src, stream, nbytes, what):
        for name, a in (("dst", dst), ("src", src)):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{what}: {name} must be an array, got {type(a).__name__}")
        n = copy_nbytes(dst, src, nbytes, what)
        rec = self._recording(stream)
        if rec is not None:
            rec.append(("copy", (dst, src, n)))
        else:
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)

    def copy_h2d_async(self, dst, src, stream=None, nbytes=None):
        # As on CUDA: an asynchronous (and capturable) H2D copy reads pinned memory.
        if isinstance(src, np.ndarray) and not emu_memory.is_inside(src, "pinned host array"):
            raise ValueError("copy_h2d_async: src must be a pinned host array from "
                             "backend.pinned_empty() (or a view of one)")
        self._copy(dst, src, stream, nbytes, "copy_h2d_async")

    def copy_d2h_async(self, dst, src, stream=None, nbytes=None):
        self._copy(dst, src, stream, nbytes, "copy_d2h_async")

    def copy_d2d_async(self, dst, src, stream=None, nbytes=None):
        self._copy(dst, src, stream, nbytes, "copy_d2d_async")

    def synchronize(self) -> None:
        self._no_capture("synchronize()")

    # ---- capture
    def begin_capture(self, stream) -> None:
        if not isinstance(stream, EmuStream):
            raise CaptureError("capture needs a stream from backend.stream() (not the default stream)")
        if self._capturing is not None:
            raise CaptureError("a stream is already capturing")
        stream._record = []
        self._capturing = stream

    def end_capture(self, stream) -> EmuGraph:
        if self._capturing is None or stream is not self._capturing:
            raise CaptureError("end_capture on a stream that is not capturing")
        ops = stream._record
        stream._record = None
        self._capturing = None
        return EmuGraph(self, ops)

    def is_capturing(self) -> bool:
        return self._capturing is not None

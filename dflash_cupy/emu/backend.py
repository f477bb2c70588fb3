"""The emulated backend: the same ``cuda_src/*.cu`` run on the CPU.

Device memory is guarded host memory (``guarded_memory``); kernels are
compiled by g++ against ``cuda/cuda_emu.h`` (``build``).

Streams as a GPU runs them: work issued to a stream (launches, copies, the
memset of ``zeros``, graph replays) is queued on it and runs later, in issue
order, when the host waits for it (stream/event/device ``synchronize``,
``to_numpy``, a successful ``event.query()``) or another stream that waits on
one of its events is drained.

Device arrays are ``device_array.DeviceArray``: as ``cupy.ndarray``, ``.get()``
reads in stream order, and implicit conversion to NumPy waits for every
stream first (or raises, as CuPy, with ``DFLASH_CUPY_EMU_IMPLICIT=raise``).

Hazards are detected when an operation is issued, from issue order and event
edges alone (so deterministically): every actor (the host, the default
stream, each stream) keeps a vector clock; an operation's accesses (a
kernel's ``const T*`` parameters are reads, other pointers reads and writes;
copies read ``src`` and write ``dst``; ``to_numpy`` reads on its stream;
``host_write``/``host_read`` declare host accesses to pinned memory) are
checked against the queued accesses of the same bytes, and two that conflict
without one being ordered before the other raise ``StreamOrderError`` naming
the array, both operations and both actors. An H2D copy also checks at run
time that the host did not rewrite its pinned source meanwhile. The default
stream is modelled as CuPy's non-blocking streams see it: no implicit
ordering with ``stream()`` streams. Capture records launches and copies on
the capturing stream and ``Graph.launch(stream)`` queues them on ``stream``
in capture order, reading pinned host buffers when they run, as a CUDA graph
does.

Debug aids (on by default, so tests always have them): fibers are scheduled
in a seeded shuffled order between barriers, shared memory is poisoned with
NaN before every block, and array overruns hit guard pages. Settings:
``DFLASH_CUPY_EMU_SCHEDULE=shuffle|forward|reverse``,
``DFLASH_CUPY_EMU_SEED`` and ``DFLASH_CUPY_EMU_THREADS`` (OS threads that
run blocks of one launch; default min(4, cores)).

``DFLASH_CUPY_EMU_LAZY=1`` builds a module (g++, and NVRTC for its resources)
at its first launch instead of in ``compile``: variants a program compiles but
never launches cost nothing (the test suite runs this way). Errors of either
compiler then surface at that launch, as ``BackendError``; the default (0)
reports them from ``compile``, as the CuPy backend does.
"""
from __future__ import annotations

import collections
import ctypes
import functools
import os
import signal
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np

from ..backends import launch_limits, nvrtc_info, signatures
from . import build as emu_build
from . import guarded_memory as emu_memory
from .device_array import DeviceArray, raw
from ..backends.base import (Backend, BackendError, CaptureError, Graph, Kernel, KernelLaunchError, Module,
                   StreamOrderError, copy_nbytes)
from ..backends.base import check_kernel_args, notify_launch, resolve_pdl

_ORDERS = {"forward": 0, "reverse": 1, "shuffle": 2}
_ERRLEN = 1024
_HOST, _NULL = 0, 1  # actor ids of the host and the default stream
QUEUE_CAP = 20000    # queued ops per stream before the oldest half runs (bounds memory)
_SIGNAMES = {signal.SIGSEGV: "invalid memory access (SIGSEGV)", signal.SIGBUS: "bus error (SIGBUS)",
             signal.SIGFPE: "arithmetic fault (SIGFPE, e.g. integer division by zero)"}


class _Op:
    """One queued piece of stream work: runs when its stream is drained, after
    the work of other streams it waits for (``waits``: (stream, clock))."""
    __slots__ = ("clock", "run", "waits")

    def __init__(self, clock: int, run, waits=()):
        self.clock, self.run, self.waits = clock, run, waits


class _Rec:
    """A queued access to a byte range of one allocation, for hazard checks."""
    __slots__ = ("start", "end", "write", "actor", "clock", "what", "where")

    def __init__(self, start, end, write, actor, clock, what, where):
        self.start, self.end, self.write = start, end, write
        self.actor, self.clock, self.what, self.where = actor, clock, what, where


class _Node:
    """A captured launch, copy or event record (replayed in capture order). ``call``: a
    launch's (kernel, grid, block, args, shared_mem, pdl), for the PDL ordering check."""
    __slots__ = ("kind", "what", "run", "accesses", "pinned", "event", "call")

    def __init__(self, kind, what, run=None, accesses=(), pinned=None, event=None, call=None):
        self.kind, self.what, self.run, self.accesses = kind, what, run, accesses
        self.pinned, self.event, self.call = pinned, event, call


def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


class EmuStream:
    """A stream of the emulated backend: work issued to it is queued and runs
    later, in issue order, when something waits for it (``synchronize``, an
    event, ``to_numpy``, a stream that waits on one of its events). As a
    context manager it is the current stream inside the block (CuPy's
    ``with stream:``)."""

    def __init__(self, backend: "EmulatedBackend", name: str, actor: int):
        self._backend = backend
        self._record: list | None = None
        self.ptr = 0 if actor == _NULL else id(self)
        self.name = name
        self._actor = actor
        self._clock = 0                 # operations issued (and event records)
        self._vc: dict = {actor: 0}     # the latest clock of every actor this stream is ordered after
        self._queue: collections.deque = collections.deque()

    def __repr__(self) -> str:
        return f"<EmuStream {self.name}>"

    def synchronize(self) -> None:
        self._backend._no_capture("stream.synchronize()")
        self._backend._host_wait(self, self._clock, self._vc)

    def is_capturing(self) -> bool:
        return self._record is not None

    def wait_event(self, event: "EmuEvent") -> None:
        """Later work on this stream runs after the work ``event`` recorded."""
        be = self._backend
        if not isinstance(event, EmuEvent):
            raise TypeError(f"wait_event needs an event from backend.event(), got {type(event).__name__}")
        if self._record is not None:
            # As CUDA: a capturing stream may only wait on events recorded in the same capture.
            if event._capture != be._capture_id:
                raise CaptureError("a capturing stream cannot wait on an event recorded outside the "
                                   "capture; order it before begin_capture (or on the replay stream)")
            return
        if event._stream is None:
            return  # never recorded: nothing to wait for (as cudaStreamWaitEvent)
        with be._mutex:
            self._clock += 1
            self._vc = _join(_join(self._vc, event._vc), be._host_vc)
            self._vc[self._actor] = self._clock
            if not event._done():
                self._queue.append(_Op(self._clock, None, ((event._stream, event._clock),)))
                be._busy.add(self)

    def __enter__(self) -> "EmuStream":
        self._backend._stream_stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        stack = self._backend._stream_stack()
        if not stack or stack[-1] is not self:
            raise RuntimeError(f"{self.name} left a `with` block it is not the current stream of")
        stack.pop()


class EmuEvent:
    def __init__(self, backend: "EmulatedBackend"):
        self._backend = backend
        self._stream: EmuStream | None = None  # where it was last recorded
        self._clock = 0
        self._vc: dict = {}
        self._capture = None                   # the capture it was recorded in, if any

    def record(self, stream: EmuStream | None = None) -> None:
        be = self._backend
        s = be._resolve(stream)
        rec = be._recording(s)
        if rec is not None:
            rec.append(_Node("event", "event record", event=self))
            self._capture = be._capture_id
            return
        be._record_event(self, s)

    def _done(self) -> bool:
        q = self._stream._queue if self._stream is not None else None
        return not q or q[0].clock > self._clock

    def synchronize(self) -> None:
        self._backend._no_capture("event.synchronize()")
        if self._stream is not None:
            self._backend._host_wait(self._stream, self._clock, self._vc)

    def query(self) -> bool:
        """True once the recorded work is done (the host then knows it is). The
        emulated device makes progress when asked: a False answer runs the
        work, so a polling loop ends."""
        s = self._stream
        if s is None or self._backend._host_vc.get(s._actor, 0) >= self._clock:
            return True  # the host already knows
        if self._done():
            if self._stream is not None:
                self._backend._host_wait(self._stream, self._clock, self._vc)
            return True
        self._backend._drain(self._stream, self._clock)
        return False


class EmuGraph(Graph):
    def __init__(self, backend: "EmulatedBackend", nodes: list):
        self._backend = backend
        self._nodes = nodes
        self.n_launches = sum(1 for n in nodes if n.kind == "launch")
        self.n_copies = sum(1 for n in nodes if n.kind == "copy")

    @property
    def launches(self) -> list[tuple]:
        """(kernel name, grid, block, shared bytes) of each captured launch, in order."""
        out = []
        for n in self._nodes:
            if n.kind == "launch":
                g, b, _, _, smem = n.run.args[:5]
                out.append((n.run.func.__self__.name, tuple(g), tuple(b), smem))
        return out

    @property
    def nodes(self) -> list[tuple]:
        """(kind, name, pdl) of each node in order: "launch" (kernel name, whether it carries
        programmatic stream serialization), "copy" or "event" (what, False)."""
        return [(n.kind, n.call[0].name if n.call else n.what, bool(n.call and n.call[5]))
                for n in self._nodes]

    @property
    def n_pdl(self) -> int:
        return sum(1 for n in self._nodes if n.call and n.call[5])

    def launch(self, stream: EmuStream | None = None) -> None:
        """Queue the captured nodes on ``stream`` (None: the current stream) in
        capture order, each checked for hazards as if issued there (and, with the
        PDL check on, each launch run by it)."""
        be = self._backend
        be._no_capture("graph.launch()")
        s = be._resolve(stream)
        chk = be.pdl_checker
        be._submit(s, [(n.what, n.run if chk is None else chk.wrap(s, n.kind, n.run, n.call),
                        n.accesses, n.pinned, n.event) for n in self._nodes])


def _raw_arg(a):
    """A kernel argument with its device arrays unwrapped (a struct's fields too)."""
    if isinstance(a, Mapping):
        return {k: raw(v) for k, v in a.items()}
    return raw(a)


class EmuKernel(Kernel):
    def __init__(self, module: "EmuModule", index: int, sig: signatures.KernelSig):
        self._module = module
        self._index = index
        self.sig = sig
        self.name = sig.name

    def _pack(self, args: Sequence[Any]):
        if isinstance(args, (tuple, list)):
            args = [_raw_arg(a) for a in args]
        check_kernel_args(self.name, self.sig.params, args, np.ndarray)
        keep, slots = [], []
        for p, a in zip(self.sig.params, args):
            if p.is_pointer:
                keep.append(a)
                slots.append(ctypes.c_void_p(a.ctypes.data))
            elif p.is_struct:  # its pointer fields hold the arrays' addresses: keep them too
                keep += [a[f.name] for f in p.fields if f.is_pointer]
                b = signatures.pack_struct(p, a, lambda v: v.ctypes.data).tobytes()
                slots.append(ctypes.create_string_buffer(b, max(len(b), 8)))
            else:
                slots.append(ctypes.create_string_buffer(a.tobytes(), max(a.dtype.itemsize, 8)))
        ptrs = (ctypes.c_void_p * max(1, len(slots)))()
        for i, s in enumerate(slots):
            ptrs[i] = ctypes.addressof(s)
        # keep[2]: the allocations the pointers point into (cuda_emu.h checks accesses against them)
        flat = list(signatures.leaves(self.sig.params, args))
        return ptrs, (keep, slots, emu_memory.launch_ranges([p for p, _ in flat], [a for _, a in flat]))

    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0,
                 stream: EmuStream | None = None, pdl: bool | None = None) -> None:
        backend = self._module.backend
        given = args   # what observers see: the arguments as the caller passed them
        args = tuple(_raw_arg(a) for a in args) if isinstance(args, (tuple, list)) else args
        cap = backend._capturing
        follows = cap is not None and bool(cap._record) and cap._record[-1].kind == "launch"
        pdl = resolve_pdl(pdl, follows, self.name)
        g, b, shared_mem = launch_limits.launch_config(self.name, grid, block, shared_mem)
        # The driver's checks (sm_90); they also keep shared_mem within the emulator's
        # SMEM_BYTES arena, which is the same opt-in limit.
        check_launch_limits(self, g, b, shared_mem)
        ptrs, keep = self._pack(args)
        # Deferred: the launch runs when its stream is drained. Access intent comes from the
        # C signature: `const T*` is read, any other pointer read and written.
        run = functools.partial(self._run, g, b, ptrs, keep, shared_mem)
        what = f"kernel {self.name}"
        accesses = [(a, not p.read_only, f"{what} ({p.name})")
                    for p, a in signatures.leaves(self.sig.params, args) if p.is_pointer]
        s = backend._resolve(stream)
        rec = backend._recording(s)
        call = (self, g, b, tuple(args), shared_mem, pdl)
        if rec is not None:
            rec.append(_Node("launch", what, run, accesses, call=call))
        else:
            chk = backend.pdl_checker
            if chk is not None:
                run = chk.wrap(s, "launch", run, call)
            backend._submit(s, [(what, run, accesses, None, None)])
        notify_launch("kernel", self.name, signatures.by_name(self.sig.params, given), stream)

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


def check_launch_limits(kernel, g, b, shared_mem) -> None:
    """The driver's per-kernel checks (``launch_limits.KernelLimits``) before an emulated
    launch: ``kernel`` has ``name`` and ``_module`` (whose ``resources`` maps kernel names
    to ``KernelResources``, or is None)."""
    lim = kernel.__dict__.get("_launch_limits")
    if lim is None:
        res = getattr(kernel._module, "resources", None)
        lim = launch_limits.KernelLimits(kernel.name, None if res is None else res.get(kernel.name))
        kernel._launch_limits = lim
    lim.check(g, b, shared_mem)


_lazy_lock = threading.Lock()


class EmuModule(Module):
    def __init__(self, backend: "EmulatedBackend", so_path, kernels, build=None):
        """``build``: lazy mode (``so_path`` None), a function returning (so_path,
        resources) that the first use of ``_lib``, ``_launch`` or ``resources`` calls."""
        self.backend = backend
        self._kernels = {k.name: EmuKernel(self, i, k) for i, k in enumerate(kernels)}
        self._pending = build
        if build is None:
            self._load(so_path)

    def __getattr__(self, name):   # only for attributes not set yet: a lazy module's build
        if name in ("_lib", "_launch", "resources") and self.__dict__.get("_pending") is not None:
            with _lazy_lock:
                build = self.__dict__.get("_pending")
                if build is not None:
                    so_path, resources = build()
                    self._load(so_path)
                    self.resources = resources
                    self._pending = None
            return getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _load(self, so_path) -> None:
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

    def get_function(self, name: str) -> EmuKernel:
        try:
            return self._kernels[name]
        except KeyError:
            raise BackendError(f"no extern \"C\" __global__ function {name!r} in module "
                               f"(has: {', '.join(self._kernels) or 'none'})") from None


class EmulatedBackend(Backend):
    name = "emulated"
    compute_capability = "90"   # it models an H200 (device_props.H200; kernels.arch_options asks)

    def __init__(self):
        sched = os.environ.get("DFLASH_CUPY_EMU_SCHEDULE", "shuffle").strip().lower()
        if sched not in _ORDERS:
            raise ValueError(f"DFLASH_CUPY_EMU_SCHEDULE={sched!r}: expected one of {tuple(_ORDERS)}")
        self.schedule = sched
        self.seed = int(os.environ.get("DFLASH_CUPY_EMU_SEED", "12345"))
        self.threads = max(1, int(os.environ.get("DFLASH_CUPY_EMU_THREADS",
                                                 min(4, os.cpu_count() or 1))))
        lazy = os.environ.get("DFLASH_CUPY_EMU_LAZY", "0").strip()
        if lazy not in ("0", "1"):
            raise ValueError(f"DFLASH_CUPY_EMU_LAZY={lazy!r}: expected 0 or 1")
        self.lazy = lazy == "1"
        self._launch_count = 0
        self._tls = threading.local()               # per thread: capture state, current streams
        self._captures = 0
        self._lock = threading.Lock()
        self._executor = None
        # ---- stream ordering: vector clocks per actor (the host, each stream)
        self._mutex = threading.RLock()
        self._host_clock = 0
        self._host_vc: dict = {_HOST: 0}
        self._actors = 1
        self.null_stream = EmuStream(self, "the default stream", _NULL)
        self._actors = 2
        self._streams = weakref.WeakSet([self.null_stream])
        self._busy: set = set()                     # streams with queued work (kept alive by it)
        self._mem: dict[int, list[_Rec]] = {}       # allocation serial -> queued accesses
        self._labels: dict[int, str] = {}
        self._ran: dict[int, int] = {}              # actor -> clock of its latest op that ran
        self._host_res: dict = {}                   # (id, write, what) -> resolved host access
        self.host_waits = 0                         # host waits that had queued work to run
        # the PDL ordering check: off unless pdl_order.check_pdl(backend) turns it on
        self.pdl_checker = None

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

    # ---- capture plumbing: per thread, as CUDA's capture modes are (one thread capturing a
    # graph does not stop another thread's unrelated work)
    @property
    def _capturing(self) -> "EmuStream | None":
        return getattr(self._tls, "capturing", None)

    @_capturing.setter
    def _capturing(self, stream) -> None:
        self._tls.capturing = stream

    @property
    def _capture_id(self):
        return getattr(self._tls, "capture_id", None)

    @_capture_id.setter
    def _capture_id(self, v) -> None:
        self._tls.capture_id = v

    def _no_capture(self, what: str) -> None:
        if self._capturing is not None:
            raise CaptureError(f"{what} is not allowed while a stream is capturing "
                               f"(it would not be recorded into the graph)")

    def _resolve(self, stream) -> EmuStream:
        if stream is None:
            return self.current_stream()
        if not isinstance(stream, EmuStream) or stream._backend is not self:
            raise TypeError(f"stream must be a stream of this emulated backend or None, "
                            f"got {type(stream).__name__}")
        return stream

    def _recording(self, stream: EmuStream):
        cap = self._capturing
        if cap is None:
            if stream._record is not None:
                raise CaptureError(f"work was issued to {stream.name}, which another thread is capturing")
            return None
        if stream is not cap:
            raise CaptureError("work was issued to another stream (or the default stream) while a stream "
                               "is capturing; issue it to the capturing stream")
        return cap._record

    # ---- current stream
    def _stream_stack(self) -> list:
        st = getattr(self._tls, "stack", None)
        if st is None:
            st = self._tls.stack = []
        return st

    def current_stream(self) -> EmuStream:
        st = self._stream_stack()
        return st[-1] if st else self.null_stream

    def as_stream(self, stream) -> EmuStream:
        return self._resolve(stream)

    # ---- hazard tracking and deferred execution
    def label(self, arr, name: str):
        arr = raw(arr)
        r = emu_memory.region(arr) if isinstance(arr, np.ndarray) and arr.size else None
        if r is not None:
            self._labels[r[0]] = name
        return arr

    def _resolve_accesses(self, accesses):
        """(serial, start, end, write, what, array description) of each tracked array."""
        out = []
        for arr, write, what in accesses:
            arr = raw(arr)
            if not isinstance(arr, np.ndarray) or arr.nbytes == 0:
                continue
            r = emu_memory.region(arr)
            if r is None:
                continue
            serial, d0, desc = r
            lo = hi = arr.ctypes.data
            for n, st in zip(arr.shape, arr.strides):
                (lo, hi) = (lo + (n - 1) * st, hi) if st < 0 else (lo, hi + (n - 1) * st)
            hi += arr.itemsize
            name = self._labels.get(serial)
            desc = f"{name!r} ({desc})" if name else desc
            out.append((serial, lo - d0, hi - d0, write, what, desc))
        return out

    def _check(self, actor_name: str, vc: dict, resolved) -> None:
        """Raise StreamOrderError if an access in ``resolved`` made with knowledge
        ``vc`` conflicts with a queued access it is not ordered after."""
        hv = self._host_vc
        for serial, lo, hi, write, what, desc in resolved:
            recs = self._mem.get(serial)
            if not recs:
                continue
            # the host knows these are done: every later operation is ordered after them
            recs[:] = [r for r in recs if hv.get(r.actor, 0) < r.clock]
            for r in recs:
                if r.end <= lo or hi <= r.start or not (write or r.write) or vc.get(r.actor, 0) >= r.clock:
                    continue
                kind = ("write-after-write" if r.write else "write-after-read") if write else "read-after-write"
                raise StreamOrderError(
                    f"{kind} hazard on {desc}, bytes [{max(lo, r.start)}, {min(hi, r.end)}): "
                    f"{what} on {actor_name} {'writes' if write else 'reads'} it while "
                    f"{r.what} on {r.where} {'writes' if r.write else 'reads'} it, and nothing orders "
                    f"the two (record an event after the first on its stream and make the other "
                    f"stream wait on it, or synchronise the host)")

    def _remember(self, vc: dict, actor: int, clock: int, where: str, resolved) -> None:
        for serial, lo, hi, write, what, _ in resolved:
            recs = self._mem.setdefault(serial, [])
            recs[:] = [r for r in recs
                       if not (lo <= r.start and r.end <= hi and (write or not r.write)
                               and vc.get(r.actor, 0) >= r.clock)]
            recs.append(_Rec(lo, hi, write, actor, clock, what, where))
        if len(self._mem) > 4096:  # forget freed allocations
            live = emu_memory.live_serials()
            for k in [k for k in self._mem if k not in live]:
                del self._mem[k]
                self._labels.pop(k, None)

    def _submit(self, s: EmuStream, items) -> None:
        """Queue ``items`` ((what, run, accesses, pinned, event)) on stream ``s``
        in order: all are checked first, so a hazard queues none of them."""
        with self._mutex:
            vc = _join(s._vc, self._host_vc)
            vc[s._actor] = s._clock + 1
            resolved = [self._resolve_accesses(acc) for _, _, acc, _, _ in items]
            for r in resolved:
                self._check(s.name, vc, r)
            for (what, run, _, pinned, event), r in zip(items, resolved):
                if event is not None:
                    s._vc = vc
                    self._record_event(event, s)
                    vc = s._vc
                    continue
                s._clock += 1
                vc[s._actor] = s._clock
                self._remember(vc, s._actor, s._clock, s.name, r)
                if pinned is not None:
                    run = self._pinned_guard(run, pinned, what, s)
                s._queue.append(_Op(s._clock, run))
            s._vc = vc
            if s._queue:
                self._busy.add(s)
                if len(s._queue) > QUEUE_CAP:  # a host that never waits: let the device catch up
                    self._drain(s, s._queue[len(s._queue) // 2].clock)

    def _pinned_guard(self, run, pinned, what: str, s: EmuStream):
        """``run`` that first checks the pinned source still holds what it held
        when the copy was issued (a host rewrite nobody declared)."""
        src, n = pinned
        snap = src.reshape(-1).view(np.uint8)[:n].tobytes()

        def guarded():
            if src.reshape(-1).view(np.uint8)[:n].tobytes() != snap:
                raise StreamOrderError(
                    f"{what} on {s.name}: its pinned source ({src.shape} {src.dtype}) was rewritten by "
                    f"the host after the copy was issued and before it ran; wait for the copy (an "
                    f"event recorded after it) before rewriting a staging buffer")
            run()
        return guarded

    def _record_event(self, event: "EmuEvent", s: EmuStream) -> None:
        with self._mutex:
            s._clock += 1
            s._vc = _join(s._vc, self._host_vc)
            s._vc[s._actor] = s._clock
            event._stream, event._clock, event._vc, event._capture = s, s._clock, dict(s._vc), None
            self._streams.add(s)

    def _drain(self, s: EmuStream, clock: int) -> bool:
        """Run ``s``'s queued work up to ``clock`` (and what it waits for);
        True if anything ran."""
        ran = False
        with self._mutex:
            q = s._queue
            while q and q[0].clock <= clock:
                op = q[0]
                for t, c in op.waits:
                    ran |= self._drain(t, c)
                q.popleft()
                self._ran[s._actor] = op.clock
                if not q:
                    self._busy.discard(s)
                if op.run is not None:
                    ran = True
                    op.run()  # a failing op is gone, as on a GPU; the error surfaces here
        return ran

    def _host_wait(self, s: EmuStream, clock: int, vc: dict) -> None:
        if self._drain(s, clock):
            self.host_waits += 1
        with self._mutex:
            self._host_vc = _join(self._host_vc, vc)

    def _host_access(self, arr, write: bool, what: str) -> None:
        arr = raw(arr)
        # Staging buffers are declared every step: remember where they live (keeps begin_step's
        # host cost on the emulator close to the product's own).
        key = (id(arr), write, what)
        hit = self._host_res.get(key)
        if hit is not None and hit[0]() is arr:
            resolved = hit[1]
        else:
            resolved = self._resolve_accesses([(arr, write, what)])
            if len(self._host_res) > 1024:
                self._host_res.clear()
            try:
                self._host_res[key] = (weakref.ref(arr), resolved)
            except TypeError:
                pass
        if not resolved:
            return
        with self._mutex:
            vc = dict(self._host_vc)
            vc[_HOST] = self._host_clock + 1
            self._check("the host", vc, resolved)
            self._host_clock += 1
            self._host_vc = vc

    def host_write(self, arr, what: str = "host write") -> None:
        self._host_access(arr, True, what)

    def host_read(self, arr, what: str = "host read") -> None:
        self._host_access(arr, False, what)

    # ---- arrays
    def empty(self, shape, dtype) -> DeviceArray:
        self._no_capture("allocation (empty)")
        a = emu_memory.guarded_empty(shape, dtype, "device array")
        if a.nbytes and emu_memory.poison_enabled():
            a.reshape(-1).view(np.uint8).fill(0xFF)  # NaN / -1: reads of unwritten memory show
        return DeviceArray(a, self)

    def zeros(self, shape, dtype) -> DeviceArray:
        """As ``cupy.zeros``: the memset is work on the current stream."""
        d = self.empty(shape, dtype)
        a = d._a
        self._submit(self.current_stream(), [("zeros (memset)", functools.partial(a.fill, 0),
                                              [(a, True, "zeros (memset)")], None, None)])
        return d

    def asarray(self, host) -> DeviceArray:
        self._no_capture("allocation (asarray)")
        if isinstance(host, DeviceArray):
            host = host.get()
        host = np.asarray(host)
        a = emu_memory.guarded_empty(host.shape, host.dtype, "device array")
        a[...] = host  # synchronous: complete for every stream (nothing can have queued work on it)
        return DeviceArray(a, self)

    def _implicit_sync(self) -> None:
        """What an implicit read of a device array waits for: every stream."""
        self.synchronize()

    def to_numpy(self, arr, stream=None) -> np.ndarray:
        self._no_capture("to_numpy (a device-to-host read)")
        arr = raw(arr)
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"arr must be an emulated device array, got {type(arr).__name__}")
        s = self._resolve(stream)
        out = np.empty(arr.shape, arr.dtype)
        self._submit(s, [("to_numpy", functools.partial(np.copyto, out, arr),
                          [(arr, False, "to_numpy")], None, None)])
        self._host_wait(s, s._clock, s._vc)
        return out

    def pinned_empty(self, shape, dtype) -> np.ndarray:
        self._no_capture("allocation (pinned_empty)")
        return emu_memory.guarded_empty(shape, dtype, "pinned host array")

    def is_device_array(self, x) -> bool:
        """True for arrays from ``empty``/``zeros``/``asarray`` (and views)."""
        if isinstance(x, DeviceArray):   # of any emulated backend: they share the process's memory
            return x.nbytes > 0
        return isinstance(x, np.ndarray) and x.nbytes > 0 and emu_memory.is_inside(x, "device array")

    # ---- code
    def compile(self, source: str, options: Sequence[str] = (), filename: str | None = None) -> EmuModule:
        self._no_capture("compile")
        if self.lazy:
            try:
                kernels = signatures.parse_kernels(source)
                emu_build.parse_extern_shared(source)
            except ValueError as e:
                raise BackendError(str(e)) from None
            mod = EmuModule(self, None, kernels, build=lambda: self._build(source, options, filename)[::2])
        else:
            so, kernels, resources = self._build(source, options, filename)
            mod = EmuModule(self, so, kernels)
            mod.resources = resources
        mod.build_args = (source, tuple(options), filename)   # counting.py builds its counting twin
        return mod

    @staticmethod
    def _build(source: str, options: Sequence[str], filename: str | None):
        """(path of the g++ module, its kernels, NVRTC's per-kernel resources) of a source."""
        # The same source must also build for the GPU (NVRTC, sm_90, alongside g++); the
        # resources of that build bound each launch.
        gpu_build = nvrtc_info.resources_for_emulator_async(source, filename, options)
        try:
            so, kernels = emu_build.build(source, options, filename)
        except (emu_build.CompileError, ValueError) as e:
            raise BackendError(str(e)) from None
        try:
            resources = gpu_build.result()
        except nvrtc_info.NvrtcCompileError as e:
            raise BackendError(f"{e}\n(the emulated backend also compiles with NVRTC for "
                               f"{nvrtc_info.ARCH}; a kernel the GPU build rejects is rejected here)") from None
        return so, kernels, resources

    # ---- streams, events, copies
    def stream(self) -> EmuStream:
        with self._mutex:
            actor = self._actors
            self._actors += 1
        s = EmuStream(self, f"stream {actor - 1}", actor)
        self._streams.add(s)
        return s

    def event(self) -> EmuEvent:
        return EmuEvent(self)

    def _copy(self, dst, src, stream, nbytes, what, pinned_src=False):
        shown = (dst, src)
        dst, src = raw(dst), raw(src)
        for name, a in (("dst", dst), ("src", src)):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{what}: {name} must be an array, got {type(a).__name__}")
        n = copy_nbytes(dst, src, nbytes, what)
        s = self._resolve(stream)
        d, sv = dst.reshape(-1).view(np.uint8)[:n], src.reshape(-1).view(np.uint8)[:n]

        def run(dst=dst, src=src):  # holds both arrays: queued work keeps its memory alive
            ctypes.memmove(dst.ctypes.data, src.ctypes.data, n)
        accesses = [(d, True, f"{what} (dst)"), (sv, False, f"{what} (src)")]
        pinned = (src, n) if pinned_src and n else None
        rec = self._recording(s)
        if rec is not None:
            rec.append(_Node("copy", what, run, accesses, pinned))
        else:
            chk = self.pdl_checker
            self._submit(s, [(what, run if chk is None else chk.wrap(s, "copy", run, None),
                              accesses, pinned, None)])
        notify_launch("copy", what.split("_")[1], shown, stream)

    def copy_h2d_async(self, dst, src, stream=None, nbytes=None):
        # As on CUDA: an asynchronous (and capturable) H2D copy reads pinned memory.
        if isinstance(src, np.ndarray) and not emu_memory.is_inside(src, "pinned host array"):
            raise ValueError("copy_h2d_async: src must be a pinned host array from "
                             "backend.pinned_empty() (or a view of one)")
        self._copy(dst, src, stream, nbytes, "copy_h2d_async", pinned_src=True)

    def copy_d2h_async(self, dst, src, stream=None, nbytes=None):
        self._copy(dst, src, stream, nbytes, "copy_d2h_async")

    def copy_d2d_async(self, dst, src, stream=None, nbytes=None):
        self._copy(dst, src, stream, nbytes, "copy_d2d_async")

    def synchronize(self) -> None:
        """Wait for every stream (``cudaDeviceSynchronize``)."""
        self._no_capture("synchronize()")
        with self._mutex:
            busy = list(self._busy)
            for s in busy:
                self._host_wait(s, s._clock, s._vc)
            # everything has run, including work of streams that are gone since
            self._host_vc = _join(self._host_vc, self._ran)
            for s in list(self._streams):
                self._host_vc = _join(self._host_vc, s._vc)

    # ---- capture
    def begin_capture(self, stream) -> None:
        if not isinstance(stream, EmuStream) or stream is self.null_stream:
            raise CaptureError("capture needs a stream from backend.stream() (not the default stream)")
        if self._capturing is not None:
            raise CaptureError("a stream is already capturing")
        if stream._record is not None:
            raise CaptureError(f"{stream.name} is already capturing (in another thread)")
        stream._record = []
        with self._lock:
            self._captures += 1
            self._capture_id = self._captures
        self._capturing = stream

    def end_capture(self, stream) -> EmuGraph:
        if self._capturing is None or stream is not self._capturing:
            raise CaptureError("end_capture on a stream that is not capturing")
        nodes = stream._record
        stream._record = None
        self._capturing = None
        self._capture_id = None
        return EmuGraph(self, nodes)

    def is_capturing(self) -> bool:
        return self._capturing is not None

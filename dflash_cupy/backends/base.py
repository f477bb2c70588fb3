"""The one seam between the CPU and the GPU on the Python side.

Every class in dflash_cupy talks to a ``Backend``; there are two:

* ``CudaBackend`` (``backends/cuda.py``): CuPy arrays, ``cupy.RawModule``
  compiled by NVRTC, CuPy streams/events, CUDA graph capture.
* ``EmulatedBackend`` (``dflash_cupy/emu/backend.py``): device arrays are
  ``DeviceArray`` over guarded host memory (CuPy's semantics), the same
  ``cuda_src/*.cu`` compiled by g++ against ``dflash_cupy/emu/cuda/cuda_emu.h``
  (threads as fibers); stream work is
  queued per stream and runs later (at synchronisation points), with every
  cross-stream or host/device race reported as ``StreamOrderError``;
  capture records launches/copies and replays them.

Calling conventions (identical on both):

* ``kernel(grid, block, args, shared_mem=0, stream=None, pdl=None)``: CuPy's
  RawKernel convention. ``args`` is a tuple of device arrays and NumPy scalars
  of the exact C type of the parameter (``np.int32`` for ``int``, ``np.float32``
  for ``float``, ``np.int64`` for ``long long``, ...). ``pdl=True`` launches with
  programmatic stream serialization (programmatic dependent launch, sm_90+: the
  kernel may start before the previous kernel on the stream ends and must order
  itself with ``pdl_wait()``, ``cuda_src/pdl.cuh``); ``None`` (the default):
  on inside ``programmatic_launches()`` for a captured launch that directly
  follows another captured launch on the capturing stream, else off.
* Copies take whole contiguous arrays of equal byte size (``nbytes`` may
  restrict to a prefix). H2D copies read *pinned* host memory when the copy
  executes — during replay, for a captured copy.
* Nothing allocates, synchronises or reads device data on the host while a
  stream is capturing: both backends raise ``CaptureError``.
* Streams as CuPy has them: ``stream=None`` everywhere means the *current*
  stream (``current_stream()``; the default stream unless a ``with stream:``
  block made another current). Streams from ``stream()`` are non-blocking:
  nothing orders them with the default stream or each other except events
  (``stream.wait_event(event)``) and host synchronisation. ``zeros`` writes
  on the current stream (as ``cupy.zeros`` does); ``asarray`` is complete for
  every stream when it returns. ``to_numpy(arr, stream=None)`` reads on the
  current (or given) stream and waits for that stream only, as
  ``cupy.ndarray.get()`` does.
"""
from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np


class BackendError(RuntimeError):
    """A backend operation failed (compile error, launch failure, ...)."""


class CaptureError(BackendError):
    """An operation that cannot be recorded was attempted during capture."""


class KernelLaunchError(BackendError):
    """A kernel failed while running (emulated: deadlock, out-of-bounds)."""


class StreamOrderError(BackendError):
    """Two operations touch the same memory, at least one writes, and nothing
    orders them (emulated backend): two streams with no event edge between
    them, or the host and queued device work (a host read of device memory,
    a host write into a pinned buffer that queued work still reads)."""


class Graph(abc.ABC):
    """A captured sequence of launches and copies, replayable any number of times."""

    @abc.abstractmethod
    def launch(self, stream: Any = None) -> None: ...


class Kernel(abc.ABC):
    name: str

    @abc.abstractmethod
    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0,
                 stream: Any = None, pdl: bool | None = None) -> None: ...


# Programmatic dependent launch: the scope is per thread (captures are per thread too).
_pdl_tls = threading.local()


@contextlib.contextmanager
def programmatic_launches(on: bool = True):
    """Inside: a captured kernel launch with ``pdl=None`` that directly follows another
    captured kernel launch on the capturing stream gets programmatic stream serialization
    (never the first launch after a copy, an event or the capture's start; never an
    eager launch). Nests; ``on=False`` turns it off inside."""
    if not isinstance(on, (bool, np.bool_)):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    prev = getattr(_pdl_tls, "on", False)
    _pdl_tls.on = bool(on)
    try:
        yield
    finally:
        _pdl_tls.on = prev


# Launch observers (profiling): per thread, like the PDL scope.
_observe_tls = threading.local()


@contextlib.contextmanager
def observe_launches(fn):
    """Inside: ``fn(kind, name, args, stream)`` after every kernel launch
    (``kind`` "kernel", ``name`` the kernel's, ``args`` its arguments by parameter
    name, ``signatures.by_name``: a struct argument under its parameter's name) and
    asynchronous copy (``kind`` "copy", ``name`` "h2d" / "d2h" / "d2d", ``args``
    ``(dst, src)``) this thread issues eagerly or into a capture, with ``stream``
    as the caller passed it (``None``: the current stream). What
    ``profiling/kernel_times.py`` times a step's kernels by, one event after
    each. Nests (inner observers run first); unused, it costs one thread-local
    lookup per launch."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    prev = getattr(_observe_tls, "fns", ())
    _observe_tls.fns = (fn,) + prev
    try:
        yield
    finally:
        _observe_tls.fns = prev


def notify_launch(kind: str, name: str, args, stream) -> None:
    """Called by the backends after a successful launch or copy (``observe_launches``)."""
    for fn in getattr(_observe_tls, "fns", ()):
        fn(kind, name, args, stream)


def resolve_pdl(pdl, follows_kernel: bool, name: str) -> bool:
    """Whether a launch carries the attribute: ``pdl`` if given (a bool), else the
    ``programmatic_launches`` rule (``follows_kernel``: a captured launch right after
    another captured launch on the capturing stream)."""
    if pdl is None:
        return bool(getattr(_pdl_tls, "on", False)) and follows_kernel
    if not isinstance(pdl, (bool, np.bool_)):
        raise TypeError(f"kernel {name}: pdl must be a bool or None, got {type(pdl).__name__}")
    return bool(pdl)


class Module(abc.ABC):
    @abc.abstractmethod
    def get_function(self, name: str) -> Kernel: ...


class AllocationLedger:
    """Bytes allocated through one backend on this thread while the ledger is open
    (``Backend.ledger()``): ``device`` (``empty``/``zeros``/``asarray``) and ``pinned``
    (``pinned_empty``) host memory, each allocation counted once (``zeros`` that calls
    ``empty`` is one)."""

    def __init__(self):
        self.device = 0
        self.pinned = 0


# allocation method -> the ledger field it adds to
_ALLOCATORS = {"empty": "device", "zeros": "device", "asarray": "device", "pinned_empty": "pinned"}
_open = threading.local()   # (id(backend)) -> [open ledgers], and the allocation call depth


def _ledgered(fn, field_name: str):
    """``fn`` (a backend allocation method) adding its array's bytes to every ledger open
    on this thread for that backend; nested allocation calls count once, at the outermost."""
    def wrapper(self, *args, **kwargs):
        ledgers = getattr(_open, "ledgers", {}).get(id(self))
        if not ledgers:
            return fn(self, *args, **kwargs)
        _open.depth = getattr(_open, "depth", 0) + 1
        try:
            arr = fn(self, *args, **kwargs)
        finally:
            _open.depth -= 1
        if _open.depth == 0:
            for led in ledgers:
                setattr(led, field_name, getattr(led, field_name) + int(arr.nbytes))
        return arr
    wrapper.__name__, wrapper.__qualname__, wrapper.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


class Backend(abc.ABC):
    """Arrays, compilation, launches, copies, streams/events and capture."""

    name: str = "?"

    def __init_subclass__(cls, **kwargs):
        # every backend's allocations are counted by open ledgers (``ledger()``), whichever
        # way the subclass implements them
        super().__init_subclass__(**kwargs)
        for name, field_name in _ALLOCATORS.items():
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "__isabstractmethod__", False):
                setattr(cls, name, _ledgered(fn, field_name))

    @contextlib.contextmanager
    def ledger(self):
        """``with backend.ledger() as led:`` counts the bytes this thread allocates through
        this backend inside the block (``AllocationLedger``)."""
        led = AllocationLedger()
        table = getattr(_open, "ledgers", None)
        if table is None:
            table = _open.ledgers = {}
        table.setdefault(id(self), []).append(led)
        try:
            yield led
        finally:
            table[id(self)].remove(led)
            if not table[id(self)]:
                del table[id(self)]

    # ---- arrays -----------------------------------------------------------
    @abc.abstractmethod
    def empty(self, shape, dtype) -> Any: ...

    @abc.abstractmethod
    def zeros(self, shape, dtype) -> Any: ...

    @abc.abstractmethod
    def asarray(self, host: np.ndarray) -> Any:
        """A new device array holding a copy of ``host`` (synchronous)."""

    @abc.abstractmethod
    def to_numpy(self, arr, stream: Any = None) -> np.ndarray:
        """A host copy of a device array, read in order on ``stream`` (None: the
        current stream) once that stream's earlier work is done; the host waits
        for that stream only (``cupy.ndarray.get()``)."""

    @abc.abstractmethod
    def pinned_empty(self, shape, dtype) -> np.ndarray:
        """A page-locked host array (a NumPy view of it)."""

    @abc.abstractmethod
    def is_device_array(self, x) -> bool: ...

    # ---- code -------------------------------------------------------------
    @abc.abstractmethod
    def compile(self, source: str, options: Sequence[str] = (),
                filename: str | None = None) -> Module:
        """Compile CUDA C source. ``options``: ``-DNAME=VALUE`` and ``-I dir``
        are honoured by both backends; other NVRTC flags only by CUDA.
        ``filename`` names the source in compiler messages."""

    # ---- streams, events, copies -------------------------------------------
    @abc.abstractmethod
    def stream(self) -> Any:
        """A new non-blocking stream with ``synchronize()``, ``is_capturing()``
        and ``wait_event(event)`` (device-side ordering after an event); as a
        context manager (``with s:``) it is the current stream inside."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream ``stream=None`` means (CuPy's ``get_current_stream()``)."""

    @abc.abstractmethod
    def as_stream(self, stream) -> Any:
        """``stream`` as this backend's stream object (None: the current stream;
        on CUDA a raw ``cupy.cuda.Stream`` is wrapped), with ``wait_event``."""

    # Declarations for the emulator's hazard tracking (no-ops on CUDA): the
    # host is about to write / has read pinned host memory that stream work
    # also touches, and a readable name for an array in hazard reports.
    def host_write(self, arr, what: str = "host write") -> None:
        """The host is about to rewrite ``arr`` (pinned memory): every queued
        operation that reads or writes it must be known complete."""

    def host_read(self, arr, what: str = "host read") -> None:
        """The host is about to read ``arr`` (pinned memory a copy writes)."""

    def label(self, arr, name: str):
        """Name ``arr``'s allocation in hazard reports; returns ``arr``."""
        return arr

    @abc.abstractmethod
    def event(self) -> Any:
        """A new event with ``record(stream)``, ``synchronize()`` and ``query()``."""

    @abc.abstractmethod
    def copy_h2d_async(self, dst, src: np.ndarray, stream=None, nbytes: int | None = None) -> None: ...

    @abc.abstractmethod
    def copy_d2h_async(self, dst: np.ndarray, src, stream=None, nbytes: int | None = None) -> None: ...

    @abc.abstractmethod
    def copy_d2d_async(self, dst, src, stream=None, nbytes: int | None = None) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    # ---- capture ----------------------------------------------------------
    @abc.abstractmethod
    def begin_capture(self, stream) -> None: ...

    @abc.abstractmethod
    def end_capture(self, stream) -> Graph: ...

    @abc.abstractmethod
    def is_capturing(self) -> bool: ...


def check_kernel_args(name: str, params, args, array_type, hint=lambda a: "") -> None:
    """The CuPy RawKernel convention, strictly: one argument per parameter,
    device arrays (``array_type``) for pointers, NumPy scalars of the exact C
    type for the rest, and for a struct parameter a mapping holding exactly its
    fields, each checked the same way. ``hint(a)`` may explain a wrong array type."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"kernel {name}: args must be a tuple, got {type(args).__name__}")
    if len(args) != len(params):
        raise TypeError(f"kernel {name} takes {len(params)} arguments "
                        f"({', '.join(p.name for p in params)}), got {len(args)}")
    for i, (p, a) in enumerate(zip(params, args)):
        if p.fields is not None:
            if not isinstance(a, Mapping):
                raise TypeError(f"kernel {name}: argument {i} ({p.name}: {p.ctype}) must be a mapping "
                                f"of its fields, got {type(a).__name__}")
            want = [f.name for f in p.fields]
            missing, extra = [k for k in want if k not in a], sorted(set(a) - set(want))
            if missing or extra:
                raise TypeError(f"kernel {name}: argument {i} ({p.name}: {p.ctype}) "
                                f"missing fields {missing}, unknown fields {extra}")
            for f in p.fields:
                _check_one(name, f"argument {i} field", f, a[f.name], array_type, hint)
        else:
            _check_one(name, f"argument {i}", p, a, array_type, hint)


def _check_one(name: str, where: str, p, a, array_type, hint) -> None:
    if p.is_pointer:
        if not isinstance(a, array_type):
            raise TypeError(f"kernel {name}: {where} ({p.name}: {p.ctype}) must be a "
                            f"device array, got {type(a).__name__}{hint(a)}")
    elif not isinstance(a, np.generic):
        raise TypeError(f"kernel {name}: {where} ({p.name}: {p.ctype}) must be a NumPy "
                        f"scalar of dtype {p.dtype}, got {type(a).__name__} {a!r}")
    elif a.dtype != np.dtype(p.dtype):
        raise TypeError(f"kernel {name}: {where} ({p.name}: {p.ctype}) needs dtype "
                        f"{p.dtype}, got {a.dtype}")


def dim3(v, what: str) -> tuple[int, int, int]:
    """A grid or block as three positive ints (a bare int or a 1-3 tuple)."""
    t = (v,) if isinstance(v, (int, np.integer)) else tuple(v)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {v!r}")
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if any(x < 1 for x in t):
        raise ValueError(f"{what} dimensions must be >= 1, got {v!r}")
    return t


def copy_nbytes(dst, src, nbytes: int | None, what: str) -> int:
    """Validated byte count of a copy between two contiguous arrays."""
    for name, a in (("dst", dst), ("src", src)):
        if not a.flags.c_contiguous:
            raise ValueError(f"{what}: {name} must be C-contiguous")
    n = src.nbytes if nbytes is None else int(nbytes)
    if n < 0 or n > src.nbytes or n > dst.nbytes:
        raise ValueError(f"{what}: nbytes={n} exceeds src ({src.nbytes} B) or dst ({dst.nbytes} B)")
    return n

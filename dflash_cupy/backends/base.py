"""The one seam between the CPU and the GPU on the Python side.

Every class in dflash_cupy talks to a ``Backend``; there are two:

* ``CudaBackend`` (``backends/cuda.py``): CuPy arrays, ``cupy.RawModule``
  compiled by NVRTC, CuPy streams/events, CUDA graph capture.
* ``EmulatedBackend`` (``backends/emulated.py``): device arrays ARE NumPy
  arrays (allocated with guard pages), the same ``cuda_src/*.cu`` compiled by
  g++ against ``cuda_src/emu/cuda_emu.h`` (threads as fibers), launches run
  synchronously on the CPU, capture records launches/copies and replays them.

Calling conventions (identical on both):

* ``kernel(grid, block, args, shared_mem=0, stream=None)``: CuPy's RawKernel
  convention. ``args`` is a tuple of device arrays and NumPy scalars of the
  exact C type of the parameter (``np.int32`` for ``int``, ``np.float32`` for
  ``float``, ``np.int64`` for ``long long``, ...).
* Copies take whole contiguous arrays of equal byte size (``nbytes`` may
  restrict to a prefix). H2D copies read *pinned* host memory when the copy
  executes — during replay, for a captured copy.
* Nothing allocates, synchronises or reads device data on the host while a
  stream is capturing: both backends raise ``CaptureError``.
"""
from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np


class BackendError(RuntimeError):
    """A backend operation failed (compile error, launch failure, ...)."""


class CaptureError(BackendError):
    """An operation that cannot be recorded was attempted during capture."""


class KernelLaunchError(BackendError):
    """A kernel failed while running (emulated: deadlock, out-of-bounds)."""


class Graph(abc.ABC):
    """A captured sequence of launches and copies, replayable any number of times."""

    @abc.abstractmethod
    def launch(self, stream: Any = None) -> None: ...


class Kernel(abc.ABC):
    name: str

    @abc.abstractmethod
    def __call__(self, grid, block, args: Sequence[Any], shared_mem: int = 0,
                 stream: Any = None) -> None: ...


class Module(abc.ABC):
    @abc.abstractmethod
    def get_function(self, name: str) -> Kernel: ...


class Backend(abc.ABC):
    """Arrays, compilation, launches, copies, streams/events and capture."""

    name: str = "?"

    # ---- arrays -----------------------------------------------------------
    @abc.abstractmethod
    def empty(self, shape, dtype) -> Any: ...

    @abc.abstractmethod
    def zeros(self, shape, dtype) -> Any: ...

    @abc.abstractmethod
    def asarray(self, host: np.ndarray) -> Any:
        """A new device array holding a copy of ``host`` (synchronous)."""

    @abc.abstractmethod
    def to_numpy(self, arr) -> np.ndarray:
        """A host copy of a device array (synchronises the device)."""

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
        and ``wait_event(event)`` (device-side ordering after an event)."""

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
    type for the rest. ``hint(a)`` may explain a wrong array type."""
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"kernel {name}: args must be a tuple, got {type(args).__name__}")
    if len(args) != len(params):
        raise TypeError(f"kernel {name} takes {len(params)} arguments "
                        f"({', '.join(p.name for p in params)}), got {len(args)}")
    for i, (p, a) in enumerate(zip(params, args)):
        if p.is_pointer:
            if not isinstance(a, array_type):
                raise TypeError(f"kernel {name}: argument {i} ({p.name}: {p.ctype}) must be a "
                                f"device array, got {type(a).__name__}{hint(a)}")
        elif not isinstance(a, np.generic):
            raise TypeError(f"kernel {name}: argument {i} ({p.name}: {p.ctype}) must be a NumPy "
                            f"scalar of dtype {p.dtype}, got {type(a).__name__} {a!r}")
        elif a.dtype != np.dtype(p.dtype):
            raise TypeError(f"kernel {name}: argument {i} ({p.name}: {p.ctype}) needs dtype "
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

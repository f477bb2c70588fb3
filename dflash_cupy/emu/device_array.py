"""The emulated backend's device array: a CuPy-like handle on guarded host
memory whose reads follow stream order.

Work on the emulated streams is queued and runs later (``backend.py``), so
the bytes of a device array may not be written yet when the host holds it.
``DeviceArray`` therefore is not an ``ndarray`` (NumPy would read its memory
without asking, as it does for any ``ndarray`` subclass); it behaves as
``cupy.ndarray`` does:

* ``.get(stream=None)`` copies to a new NumPy array in stream order (waits for
  the work queued on ``stream``, the current stream by default), as
  ``backend.to_numpy``;
* metadata (``shape``, ``dtype``, ``strides``, ``flags``, ``nbytes``, ...) and
  views (indexing with slices and integers, ``reshape``, ``view``, ``ravel``,
  ``T``, ``transpose``) need no wait and stay device arrays;
* implicit conversion (``np.asarray``, ``np.array``, ``__array__``, NumPy
  functions and operators, ``float()``, ``repr``, DLPack export) first waits
  for every stream (``backend.synchronize()``), so it never sees memory that
  queued work has not written yet. With ``DFLASH_CUPY_EMU_IMPLICIT=raise``,
  ``__array__`` raises ``TypeError`` exactly as CuPy does, to check that code
  is portable to the GPU. The buffer protocol is not offered (as CuPy).
* writes (``a[k] = v``, ``fill``) are ordered too: ``fill`` is queued on the
  current stream, item assignment waits for every stream first.
"""
from __future__ import annotations

import functools
import os

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

IMPLICIT_MODES = ("sync", "raise")
CUPY_IMPLICIT_MESSAGE = ("Implicit conversion to a NumPy array is not allowed. "
                         "Please use `.get()` to construct a NumPy array explicitly.")


def implicit_mode() -> str:
    mode = os.environ.get("DFLASH_CUPY_EMU_IMPLICIT", "sync").strip().lower()
    if mode not in IMPLICIT_MODES:
        raise ValueError(f"DFLASH_CUPY_EMU_IMPLICIT={mode!r}: expected one of {IMPLICIT_MODES}")
    return mode


def raw(x):
    """The ``ndarray`` behind a device array (anything else unchanged): for the
    backend's own plumbing (kernel pointers, copies, hazard records), which
    orders its accesses itself."""
    return x._a if type(x) is DeviceArray else x


def _full_index(key) -> bool:
    """``key`` picks single elements (ints only): append ``...`` to get a 0-d view."""
    if isinstance(key, (int, np.integer)):
        return True
    return isinstance(key, tuple) and all(isinstance(k, (int, np.integer)) for k in key)


class MemoryPointer:
    """``cupy.cuda.MemoryPointer``'s ``ptr``: the address, no wait."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = int(ptr)


class DeviceArray(NDArrayOperatorsMixin):
    """A device array of the emulated backend (see the module docstring)."""
    __slots__ = ("_a", "_be", "__weakref__")
    __array_priority__ = 100

    def __init__(self, a: np.ndarray, backend):
        if not isinstance(a, np.ndarray):
            raise TypeError(f"a must be an ndarray, got {type(a).__name__}")
        self._a = a
        self._be = backend

    # ---- metadata: no wait
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)
    ctypes = property(lambda self: self._a.ctypes)
    data = property(lambda self: MemoryPointer(self._a.ctypes.data))   # ``.data.ptr`` as in CuPy
    T = property(lambda self: self._view(self._a.T))

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        for i in range(len(self._a)):
            yield self[i]

    # ---- views: no wait (an operation that turns out to copy waits, and gives a device array)
    def _view(self, r) -> "DeviceArray":
        return DeviceArray(r, self._be)

    def _derive(self, fn) -> "DeviceArray":
        r = fn(self._a)
        if isinstance(r, np.ndarray) and r.size and np.may_share_memory(r, self._a):
            return self._view(r)
        if isinstance(r, np.ndarray) and r.size == 0:
            return self._view(r)
        self._sync()
        return self._be.asarray(np.asarray(fn(self._a)))

    def __getitem__(self, key):
        if _full_index(key):
            key = (key if isinstance(key, tuple) else (key,)) + (Ellipsis,)
        return self._derive(lambda a: a[key])

    def reshape(self, *shape, **kw) -> "DeviceArray":
        return self._derive(lambda a: a.reshape(*shape, **kw))

    def view(self, *args, **kw) -> "DeviceArray":
        return self._view(self._a.view(*args, **kw))

    def ravel(self, order="C") -> "DeviceArray":
        return self._derive(lambda a: a.ravel(order))

    def transpose(self, *axes) -> "DeviceArray":
        return self._view(self._a.transpose(*axes))

    def squeeze(self, axis=None) -> "DeviceArray":
        return self._view(self._a.squeeze(axis))

    # ---- copies on the device
    def copy(self, order="C") -> "DeviceArray":
        if self._a.flags.c_contiguous and order in ("C", "A", "K"):
            be = self._be
            out = be.empty(self.shape, self.dtype)
            be._submit(be.current_stream(), [("copy", functools.partial(np.copyto, out._a, self._a),
                                              [(out._a, True, "copy (dst)"), (self._a, False, "copy (src)")],
                                              None, None)])
            return out
        self._sync()
        return self._be.asarray(np.ascontiguousarray(self._a))

    def astype(self, dtype, copy=True) -> "DeviceArray":
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        self._sync()
        return self._be.asarray(self._a.astype(dtype))

    def fill(self, value) -> None:
        """As ``cupy.ndarray.fill``: queued on the current stream."""
        be = self._be
        be._submit(be.current_stream(), [("fill", functools.partial(self._a.fill, value),
                                          [(self._a, True, "fill")], None, None)])

    def __setitem__(self, key, value) -> None:
        self._sync()
        self._a[key] = np.asarray(value)

    # ---- reads
    def get(self, stream=None, order="C", out=None) -> np.ndarray:
        """A NumPy copy, read in stream order (``cupy.ndarray.get``)."""
        host = self._be.to_numpy(self._a, stream)
        if out is None:
            return host if order in ("C", "A", "K") else np.asfortranarray(host)
        if not isinstance(out, np.ndarray) or out.shape != host.shape or out.dtype != host.dtype:
            raise ValueError(f"out must be a NumPy array of shape {host.shape} and dtype {host.dtype}")
        out[...] = host
        return out

    def _sync(self) -> None:
        self._be._implicit_sync()

    def __array__(self, dtype=None, copy=None):
        if implicit_mode() == "raise":
            raise TypeError(CUPY_IMPLICIT_MESSAGE)
        self._sync()
        a = self._a
        if dtype is not None and np.dtype(dtype) != a.dtype:
            return a.astype(dtype)
        return a.copy() if copy else a

    def __array_ufunc__(self, ufunc, method, *inputs, **kw):
        if implicit_mode() == "raise":
            raise TypeError(f"{ufunc.__name__} on an emulated device array: {CUPY_IMPLICIT_MESSAGE}")
        self._sync()
        inputs = tuple(raw(x) for x in inputs)
        if "out" in kw:
            kw["out"] = tuple(raw(x) for x in kw["out"])
        return getattr(ufunc, method)(*inputs, **kw)

    def __dlpack__(self, *, stream=None, **kw):
        """DLPack export: CPU memory, complete (every stream waited for) when exported."""
        self._sync()
        return self._a.__dlpack__(stream=stream, **kw) if stream is not None else self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()

    def _scalar(self):
        self._sync()
        return self._a

    def __bool__(self) -> bool:
        return bool(self._scalar())

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def __index__(self) -> int:
        return self._scalar().__index__()

    def __complex__(self) -> complex:
        return complex(self._scalar())

    def __repr__(self) -> str:
        return repr(self._scalar()).replace("array(", "device_array(", 1)

    def __str__(self) -> str:
        return str(self._scalar())

    def __getattr__(self, name):
        # Other ndarray methods (``sum``, ``tolist``, ``item``, ``tobytes``, ...) read the values:
        # on the host, after every stream is waited for.
        if name.startswith("__") or not hasattr(np.ndarray, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if implicit_mode() == "raise":
            raise TypeError(f"ndarray.{name} on an emulated device array: {CUPY_IMPLICIT_MESSAGE}")
        self._sync()
        return getattr(self._a, name)

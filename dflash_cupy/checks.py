"""Argument checks shared by the launchers and the product classes: a bad
argument raises an exception naming it — TypeError for the wrong kind of
value, ValueError for a value out of range — before anything changes."""
from __future__ import annotations

import numpy as np


def int_arg(v, name: str, minimum: int = 0) -> int:
    """``v`` as an int >= ``minimum`` (bools and floats are not ints)."""
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
        raise TypeError(f"{name} must be an int, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{name}={v} must be >= {minimum}")
    return int(v)


def float_arg(v, name: str) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {v!r}") from None


def ptr(a) -> int:
    """Device address of an array (CuPy ``data.ptr``, NumPy ``ctypes.data``), no sync."""
    d = getattr(a, "data", None)
    p = getattr(d, "ptr", None)
    return int(p) if p is not None else int(a.ctypes.data)


def overlaps(a, b) -> bool:
    pa, pb = ptr(a), ptr(b)
    return pa < pb + b.nbytes and pb < pa + a.nbytes


def check_no_overlap(**arrays) -> None:
    """ValueError naming the first pair of the given arrays that share memory."""
    items = list(arrays.items())
    for i, (na, a) in enumerate(items):
        for nb, b in items[i + 1:]:
            if overlaps(a, b):
                raise ValueError(f"{na} must not overlap {nb}")


def device_array(backend, name, a, dtype, ndim=2) -> None:
    """``a`` is a C-contiguous device array of ``backend`` with ``dtype`` (and ``ndim``)."""
    if not backend.is_device_array(a):
        raise TypeError(f"{name} must be a device array of backend {backend.name!r}, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(a.shape)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")


def aligned16(**arrays) -> None:
    for name, a in arrays.items():
        if ptr(a) % 16:
            raise ValueError(f"{name} must be 16-byte aligned (vectorised loads), address {ptr(a):#x}")


def bool_arg(v, name: str) -> bool:
    """``v`` as a bool (Python or NumPy bool only: 0/1 and strings are refused)."""
    if not isinstance(v, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__} {v!r}")
    return bool(v)


def tile_flags(backend, tile_live, rows: int, rows_name: str = "rows") -> None:
    """A kernel's ``tile_live`` (device int32, one flag per 16 rows): it must cover ``rows``."""
    device_array(backend, "tile_live", tile_live, np.int32, ndim=1)
    if tile_live.shape[0] < -(-rows // 16):
        raise ValueError(f"tile_live must hold >= ceil({rows_name}/16) = {-(-rows // 16)} entries, "
                         f"got shape {tuple(tile_live.shape)}")

"""The three storage types of weights and feature rows: f32, f16 and bf16.

On the device bf16 lives as uint16 bit patterns (CuPy has no bfloat16); on
the host NumPy sees it as ``ml_dtypes.bfloat16``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

KINDS = ("f32", "f16", "bf16")
CODE = {"f32": 0, "f16": 1, "bf16": 2}            # the -D value kernels take
DEVICE = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(np.uint16)}
HOST = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


def kind_of(dtype, what: str) -> str:
    """``"f32" | "f16" | "bf16"`` from a name or a dtype (``np.uint16`` and
    ``ml_dtypes.bfloat16`` both mean bf16); TypeError naming ``what`` otherwise."""
    if isinstance(dtype, str) and dtype in CODE:
        return dtype
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what} {dtype!r}: expected 'f32', 'f16', 'bf16' or a NumPy dtype") from None
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if dt == np.uint16 or dt == HOST["bf16"]:
        return "bf16"
    raise TypeError(f"{what} {dtype!r}: expected float32, float16 or bfloat16")


def device_bits(a: np.ndarray) -> np.ndarray:
    """A contiguous host array in its device representation (bf16 -> uint16 view)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype == HOST["bf16"] else a

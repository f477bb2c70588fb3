"""The three storage types of weights and feature rows: f32, f16 and bf16 —
the package's one dtype vocabulary (names, NumPy dtypes, kernel codes,
safetensors names).

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
SAFETENSORS = {"f32": "F32", "f16": "F16", "bf16": "BF16"}
# names a user may write for a kind
ALIASES = {"f32": "f32", "float32": "f32", "fp32": "f32",
           "f16": "f16", "float16": "f16", "fp16": "f16", "half": "f16",
           "bf16": "bf16", "bfloat16": "bf16"}


def kind_of(dtype, what: str, *, bits: bool = True) -> str:
    """``"f32" | "f16" | "bf16"`` from a name (``ALIASES``) or a dtype;
    ``ml_dtypes.bfloat16`` means bf16, and so does ``np.uint16`` (device bit
    patterns) unless ``bits=False``. TypeError naming ``what`` otherwise."""
    if isinstance(dtype, str):
        kind = ALIASES.get(dtype.lower())
        if kind is None:
            raise TypeError(f"{what}={dtype!r}: expected one of 'f32', 'f16', 'bf16'")
        return kind
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what}={dtype!r}: expected 'f32', 'f16', 'bf16' or a NumPy dtype") from None
    if dt == np.float32:
        return "f32"
    if dt == np.float16:
        return "f16"
    if dt == HOST["bf16"] or (bits and dt == np.uint16):
        return "bf16"
    raise TypeError(f"{what}={dtype!r}: expected float32, float16 or bfloat16")


def host_dtype(dtype, what: str = "dtype") -> np.dtype:
    """The host NumPy dtype of a name or dtype (bf16 -> ``ml_dtypes.bfloat16``;
    uint16 bit patterns are not a host weight type)."""
    return HOST[kind_of(dtype, what, bits=False)]


def device_bits(a: np.ndarray) -> np.ndarray:
    """A contiguous host array in its device representation (bf16 -> uint16 view)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype == HOST["bf16"] else a


def to_float(a, dtype=np.float64) -> np.ndarray:
    """Exact widening of a host or device-layout array to ``dtype`` (f32 or f64):
    f32, f16, ``ml_dtypes.bfloat16``, or uint16 bf16 bit patterns."""
    a = np.asarray(a)
    if a.dtype == np.uint16:
        a = a.view(HOST["bf16"])
    kind_of(a.dtype, "array dtype", bits=False)
    return a.astype(dtype)

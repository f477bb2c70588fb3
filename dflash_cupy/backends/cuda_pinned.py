"""Page-locked host buffers for the CuPy backend: allocating them and asking
whether an array lives in one.

Allocation is ``cupyx.empty_pinned`` (CuPy's pinned memory pool; the NumPy
array's base keeps the block alive). Whether memory is pinned is the driver's
answer, ``cudaPointerGetAttributes`` (``cupy.cuda.runtime.pointerGetAttributes``,
CuPy 13 and 14): its ``type`` is ``cudaMemoryTypeHost`` for page-locked host
memory and ``cudaMemoryTypeUnregistered`` for pageable memory (CUDA >= 11).
The backend needs the answer because an H2D copy from pageable memory makes
``cudaMemcpyAsync`` synchronous and cannot be replayed by a captured graph.
"""
from __future__ import annotations

import numpy as np

import cupyx
from cupy.cuda import runtime as _runtime


def pinned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous NumPy array in page-locked host memory."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
    if any(s < 0 for s in shape):
        raise ValueError(f"shape {shape} has a negative dimension")
    return cupyx.empty_pinned(shape, dtype)


def host_ptr(a: np.ndarray) -> int:
    """The address of ``a``'s first byte."""
    return int(a.__array_interface__["data"][0])


# cudaMemoryTypeHost is 1 in CUDA's driver_types.h; the getattr covers a CuPy that
# does not export the constant.
_MEMORY_TYPE_HOST = getattr(_runtime, "memoryTypeHost", 1)


def _is_page_locked(ptr: int) -> bool:
    try:
        return _runtime.pointerGetAttributes(ptr).type == _MEMORY_TYPE_HOST
    except _runtime.CUDARuntimeError:  # pre-CUDA-11 drivers refuse pageable pointers
        return False


def is_pinned(a) -> bool:
    """True if ``a`` is a NumPy array whose first and last bytes are page-locked host
    memory. (The driver reports no allocation bounds for host memory; buffers from
    ``pinned_empty`` are single allocations, so the two ends decide.) An empty array
    has no bytes to copy and is reported as not pinned."""
    if not isinstance(a, np.ndarray) or a.nbytes == 0:
        return False
    start = host_ptr(a)
    return _is_page_locked(start) and _is_page_locked(start + a.nbytes - 1)


__all__ = ["pinned_empty", "is_pinned"]

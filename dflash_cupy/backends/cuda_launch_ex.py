"""``cuLaunchKernelEx`` through ctypes: a kernel launch with launch attributes, which
CuPy's ``RawKernel.__call__`` cannot set. Used for programmatic dependent launch
(``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``), no new dependency:
the driver library CuPy itself loads (``libcuda.so.1``), the ``CUfunction`` CuPy
loaded (``RawKernel.kernel.ptr``) and arguments packed as CuPy packs them for a
raw kernel (a device array as its data pointer, a NumPy scalar as its bytes).
The launch is ordinary stream work: inside a stream capture it becomes a kernel
node, with a programmatic edge from the kernel node before it.

Driver API facts relied on (cuda.h, CUDA 12.0+; the layout is part of the ABI):

* ``CUresult cuLaunchKernelEx(const CUlaunchConfig*, CUfunction, void** kernelParams,
  void** extra)``;
* ``CUlaunchConfig``: ``gridDimX/Y/Z, blockDimX/Y/Z, sharedMemBytes`` (unsigned int),
  ``hStream`` (CUstream), ``attrs`` (CUlaunchAttribute*), ``numAttrs`` (unsigned int);
* ``CUlaunchAttribute``: ``id`` (an enum, 4 bytes), 4 bytes of padding, ``value`` (a
  64-byte union whose ``programmaticStreamSerializationAllowed`` is an int at offset 0);
* ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` = 6.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
CUDA_SUCCESS = 0


class CUlaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64),
                ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class CUlaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", CUlaunchAttributeValue)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint)]


LAUNCH_EX_ARGTYPES = (ctypes.POINTER(CUlaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                      ctypes.c_void_p)
# The C signature, for a stand-in (tests) with the same calling convention.
LAUNCH_EX_PROTO = ctypes.CFUNCTYPE(ctypes.c_int, *LAUNCH_EX_ARGTYPES)

_fn = None   # the driver's cuLaunchKernelEx, loaded at the first programmatic launch


class LaunchExError(RuntimeError):
    """cuLaunchKernelEx is missing or returned an error (``.status``: the CUresult)."""

    def __init__(self, msg: str, status: int = -1):
        super().__init__(msg)
        self.status = status


def driver_function():
    """``cuLaunchKernelEx`` of ``libcuda.so.1`` (the library CuPy's driver calls use)."""
    global _fn
    if _fn is None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            f = lib.cuLaunchKernelEx
        except (OSError, AttributeError) as e:
            raise LaunchExError(f"cuLaunchKernelEx is not available (a CUDA 12 driver is needed for "
                                f"programmatic dependent launch): {e}") from None
        f.restype = ctypes.c_int
        f.argtypes = LAUNCH_EX_ARGTYPES
        _fn = f
    return _fn


def pack_args(params, args: Sequence) -> tuple:
    """``(void** array, keep-alive list)`` for ``kernelParams``: per parameter the address of
    a slot holding its value: a device array's data pointer (``.data.ptr``), a NumPy scalar's
    bytes (its exact C type, checked before by ``check_kernel_args``)."""
    slots = []
    for p, a in zip(params, args):
        if p.is_pointer:
            slots.append(ctypes.c_void_p(int(a.data.ptr)))
        else:
            b = np.asarray(a).tobytes()
            slots.append(ctypes.create_string_buffer(b, max(len(b), 8)))
    arr = (ctypes.c_void_p * max(1, len(slots)))()
    for i, s in enumerate(slots):
        arr[i] = ctypes.addressof(s)
    return arr, slots


def launch(func_ptr: int, grid, block, shared_mem: int, stream_ptr: int, params, args, *,
           programmatic: bool = True, fn=None) -> None:
    """One launch of ``func_ptr`` (a CUfunction) on ``stream_ptr`` with programmatic stream
    serialization allowed (``programmatic``); ``fn``: the entry point (default: the
    driver's). Raises ``LaunchExError`` with the CUresult on failure."""
    fn = driver_function() if fn is None else fn
    attr = CUlaunchAttribute()
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value.programmaticStreamSerializationAllowed = 1 if programmatic else 0
    cfg = CUlaunchConfig(*(int(v) for v in grid), *(int(v) for v in block), int(shared_mem),
                         ctypes.c_void_p(int(stream_ptr) or None), ctypes.pointer(attr), 1)
    kp, keep = pack_args(params, args)
    rc = fn(ctypes.byref(cfg), ctypes.c_void_p(int(func_ptr)), kp, None)
    del keep
    if rc != CUDA_SUCCESS:
        raise LaunchExError(f"cuLaunchKernelEx failed with CUresult {rc}", rc)

"""Foreign arrays in, zero-copy: CuPy, PyTorch, JAX or anything exposing
``__cuda_array_interface__`` or ``__dlpack__`` becomes a device array of the
backend that views the same memory.

``device_view(backend, obj, name, dtype=, shape=)`` returns that view, or
``None`` when ``obj`` is host data (NumPy arrays, array-interface objects):
the caller then takes its host path (a copy through pinned staging). On the
emulated backend device memory is host memory: its own arrays and CPU
DLPack objects (a PyTorch or JAX CPU tensor) play the device arrays, so the
interop paths run on a CPU. Anything else — a GPU array on another device,
a non-contiguous view, the wrong dtype or shape — raises an exception that
names ``name`` and says what is wrong; nothing is copied silently.

Outputs go the other way without help: CuPy and NumPy arrays both export
``__dlpack__``, so ``torch.from_dlpack(kv.hidden_states)`` is zero-copy.
"""
from __future__ import annotations

import numpy as np

_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


def _dlpack_device(obj):
    try:
        dev_type, dev_id = obj.__dlpack_device__()
        return int(dev_type), int(dev_id)
    except Exception:
        return None


def _describe(obj) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


def _check(arr, name: str, dtype, shape):
    if dtype is not None:
        want = [np.dtype(d) for d in (dtype if isinstance(dtype, (tuple, list)) else (dtype,))]
        if np.dtype(arr.dtype) not in want:
            raise TypeError(f"{name} must have dtype {' or '.join(d.name for d in want)}, got {arr.dtype}")
    if shape is not None:
        got = tuple(int(s) for s in arr.shape)
        if len(got) != len(shape) or any(w is not None and w != g for w, g in zip(shape, got)):
            want_s = "[" + ", ".join("*" if w is None else str(w) for w in shape) + "]"
            raise ValueError(f"{name} must have shape {want_s}, got {list(got)}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {tuple(arr.strides)}); "
                         f"pass a contiguous copy")
    return arr


def array_like(obj) -> bool:
    """Whether ``obj`` may be an array ``device_view`` takes (a host int or a list is not)."""
    return any(hasattr(obj, a) for a in ("__dlpack__", "__cuda_array_interface__", "__array_interface__"))


def device_view(backend, obj, name: str, *, dtype=None, shape=None):
    """``obj`` as a device array of ``backend`` sharing its memory, or ``None``
    for host data. ``shape`` may hold ``None`` for any extent."""
    if backend.name == "emulated":
        return _emulated_view(backend, obj, name, dtype, shape)
    return _cuda_view(obj, name, dtype, shape)


def _emulated_view(backend, obj, name, dtype, shape):
    if backend.is_device_array(obj) and not isinstance(obj, np.ndarray):
        return _check(obj, name, dtype, shape)   # the backend's own device array
    if isinstance(obj, np.ndarray):
        return _check(obj, name, dtype, shape) if backend.is_device_array(obj) else None
    dev = _dlpack_device(obj) if hasattr(obj, "__dlpack__") else None
    if dev is not None:
        if dev[0] not in (_DL_CPU, _DL_CUDA_HOST):
            raise ValueError(f"{name}: a {_describe(obj)} on DLPack device {dev} cannot be read by the "
                             f"emulated backend (it runs kernels on host memory)")
        try:
            arr = np.from_dlpack(obj)
        except (TypeError, BufferError, RuntimeError) as e:
            raise TypeError(f"{name}: cannot view {_describe(obj)} through DLPack ({e})") from None
        return _check(arr, name, dtype, shape)
    if hasattr(obj, "__array_interface__"):
        return None
    raise TypeError(f"{name} must be an array (NumPy, DLPack or array-interface object), "
                    f"got {_describe(obj)}")


def _cuda_view(obj, name, dtype, shape):
    import cupy
    if isinstance(obj, np.ndarray):
        return None
    if isinstance(obj, cupy.ndarray):
        arr = obj
    elif hasattr(obj, "__cuda_array_interface__"):
        arr = cupy.asarray(obj)  # zero-copy: CuPy wraps the pointer
    elif hasattr(obj, "__dlpack__"):
        dev = _dlpack_device(obj)
        if dev is not None and dev[0] == _DL_CPU:
            return None
        if dev is not None and dev[0] not in (_DL_CUDA, _DL_CUDA_MANAGED):
            raise ValueError(f"{name}: a {_describe(obj)} on DLPack device {dev} is not CUDA memory")
        arr = cupy.from_dlpack(obj)
    elif hasattr(obj, "__array_interface__"):
        return None
    else:
        raise TypeError(f"{name} must be an array (CuPy, PyTorch, JAX, NumPy, ...), got {_describe(obj)}")
    here = cupy.cuda.runtime.getDevice()
    if arr.device.id != here:
        raise ValueError(f"{name} lives on CUDA device {arr.device.id}, this module runs on device {here}")
    return _check(arr, name, dtype, shape)

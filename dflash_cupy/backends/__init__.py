"""Backend selection: ``get(name=None)`` returns the process-wide backend.

``None`` picks ``"cuda"`` when CuPy sees a GPU, otherwise ``"emulated"``;
the environment variable ``DFLASH_CUPY_BACKEND=cuda|emulated`` overrides the
automatic choice (an explicit ``name`` wins over both).
"""
from __future__ import annotations

import os

from .base import (Backend, BackendError, CaptureError, Graph, Kernel,  # noqa: F401
                   KernelLaunchError, Module, StreamOrderError)

NAMES = ("cuda", "emulated")
ENV_VAR = "DFLASH_CUPY_BACKEND"
PDL_CHECK_ENV = "DFLASH_CUPY_EMU_PDL_CHECK"   # the emulated backend's PDL ordering check (emu/pdl_order.py)
_instances: dict[str, Backend] = {}


def gpu_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def get(name: str | Backend | None = None) -> Backend:
    if isinstance(name, Backend):
        return name
    if name is None:
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env:
            if env not in NAMES:
                raise ValueError(f"{ENV_VAR}={env!r}: expected one of {NAMES}")
            name = env
        else:
            name = "cuda" if gpu_available() else "emulated"
    if name not in NAMES:
        raise ValueError(f"backend name {name!r}: expected one of {NAMES}")
    if name not in _instances:
        if name == "cuda":
            if not gpu_available():
                raise BackendError("backend 'cuda' requested but CuPy sees no CUDA GPU "
                                   "(use 'emulated' to run the kernels on the CPU)")
            from .cuda import CudaBackend
            _instances[name] = CudaBackend()
        else:
            from ..emu.backend import EmulatedBackend
            be = EmulatedBackend()
            if os.environ.get(PDL_CHECK_ENV, "0").strip() not in ("", "0"):
                from ..emu.pdl_order import check_pdl
                check_pdl(be)
            _instances[name] = be
    return _instances[name]

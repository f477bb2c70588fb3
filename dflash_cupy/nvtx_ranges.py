"""NVTX ranges under one domain ("dflash_cupy"), free when no profiler is
attached. ``nvtx`` is optional (the ``bench`` and ``test`` extras install
it): without it the ranges are no-ops, so the product runs where it cannot be
installed (the GPU check machine has no network)."""
from __future__ import annotations

import contextlib

DOMAIN = "dflash_cupy"

try:
    import nvtx as _nvtx
except Exception:  # pragma: no cover - depends on the machine
    _nvtx = None


def available() -> bool:
    return _nvtx is not None


def nvtx_range(name: str, color: str = "blue"):
    """``with nvtx_range("plan"): ...``"""
    if _nvtx is None:
        return contextlib.nullcontext()
    return _nvtx.annotate(name, color=color, domain=DOMAIN)

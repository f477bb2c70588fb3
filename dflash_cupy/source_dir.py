"""Where the kernel sources are: ``cuda_src/`` inside the installed package
(a wheel carries them as ``dflash_cupy/cuda_src``), else the source tree's
top-level ``cuda_src/`` (an editable install or a checkout on ``sys.path``).
``DFLASH_CUPY_CUDA_SRC`` overrides both. A leaf module: every layer may import it."""
from __future__ import annotations

import os
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _find() -> Path:
    env = os.environ.get("DFLASH_CUPY_CUDA_SRC")
    if env:
        return Path(env)
    for cand in (_HERE / "cuda_src", _HERE.parent / "cuda_src"):
        if cand.is_dir() and any(cand.glob("*.cu")):
            return cand
    raise FileNotFoundError(f"dflash_cupy: kernel sources not found in {_HERE / 'cuda_src'} or "
                            f"{_HERE.parent / 'cuda_src'} (a broken install? set DFLASH_CUPY_CUDA_SRC)")


CUDA_SRC = _find()

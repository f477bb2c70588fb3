"""Where compiled kernels are cached on disk: the emulator's g++ modules and,
beside them, NVRTC's resource reports (``<cache_dir>/nvrtc``).
``DFLASH_CUPY_EMU_CACHE`` overrides the default ``$XDG_CACHE_HOME/dflash_cupy/emu``.
A leaf module: every layer may import it."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    d = Path(os.environ.get("DFLASH_CUPY_EMU_CACHE",
                            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "dflash_cupy" / "emu"))
    d.mkdir(parents=True, exist_ok=True)
    return d

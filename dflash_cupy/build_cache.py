"""Where compiled kernels are cached on disk: the emulator's g++ modules and,
beside them, NVRTC's resource reports (``<cache_dir>/nvrtc``), and the lock that
lets concurrent processes (pytest-xdist workers) fill the cache without building
an entry twice. ``DFLASH_CUPY_EMU_CACHE`` overrides the default
``$XDG_CACHE_HOME/dflash_cupy/emu``. A leaf module: every layer may import it."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no cross-process lock (the writers' atomic renames still hold)
    fcntl = None


def cache_dir() -> Path:
    d = Path(os.environ.get("DFLASH_CUPY_EMU_CACHE",
                            Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
                            / "dflash_cupy" / "emu"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def key_lock(key: str):
    """Exclusive per-key lock across processes and threads (``flock`` on
    ``<cache_dir>/.locks/<key>``; released when the descriptor closes, also if the
    holder dies): an entry another process is building is waited for, not built twice."""
    if fcntl is None:
        yield
        return
    d = cache_dir() / ".locks"
    d.mkdir(exist_ok=True)
    fd = os.open(d / key, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)

"""Loading ``cuda_src/*.cu`` onto a backend with compile-time sizes.

Every kernel file takes its sizes as ``-D`` macros; ``compile_options`` is
the one function that builds them, so the CUDA and emulated builds of a file
see exactly the same constants. Modules are cached per (backend, file,
options).
"""
from __future__ import annotations

from pathlib import Path

from .source_dir import CUDA_SRC

_cache: dict = {}


def compile_options(**defines) -> tuple[str, ...]:
    """``-DNAME=VALUE`` for each size (ints/floats/bools), sorted for stable cache keys."""
    opts = []
    for k in sorted(defines):
        v = defines[k]
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (int, float)):
            raise TypeError(f"compile-time size {k}={v!r} must be an int, float or bool")
        opts.append(f"-D{k}={v}")
    return ("-I" + str(CUDA_SRC),) + tuple(opts)


def source_path(filename: str) -> Path:
    p = CUDA_SRC / filename
    if not p.is_file():
        raise FileNotFoundError(f"kernel source {filename!r} not found in {CUDA_SRC}")
    return p


def load_module(backend, filename: str, **defines):
    """Compile (or fetch from cache) ``cuda_src/<filename>`` for ``backend``."""
    opts = compile_options(**defines)
    key = (id(backend), filename, opts)
    mod = _cache.get(key)
    if mod is None:
        path = source_path(filename)
        mod = backend.compile(path.read_text(), opts, filename=str(path))
        _cache[key] = mod
    return mod

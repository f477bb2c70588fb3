"""Loading ``cuda_src/*.cu`` onto a backend with compile-time sizes, and
reading the constants the CUDA sources define.

Constants flow one way per constant: sizes a launcher chooses go to the
kernel as ``-D`` macros (``compile_options``, the one function that builds
them, so the CUDA and emulated builds of a file see the same values); layouts
and tile sizes the kernels fix (the step descriptor, attention's key tile)
are ``#define`` lines in ``cuda_src`` that Python reads with ``constants``.
Modules are cached per (backend, file, options).
"""
from __future__ import annotations

import functools
import re
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


_IFNDEF = re.compile(r"\s*#\s*ifndef\s+(\w+)")
_DEFINE = re.compile(r"\s*#\s*define\s+(\w+)\s+(-?\d+)\s*(//.*)?$")


@functools.lru_cache(maxsize=None)
def constants(filename: str) -> dict[str, int]:
    """The integer constants ``cuda_src/<filename>`` fixes: each
    ``#define NAME <integer>``, except the ``#ifndef NAME`` defaults of sizes
    that launchers set with ``-D``."""
    out, defaults = {}, set()
    for line in source_path(filename).read_text().splitlines():
        m = _IFNDEF.match(line)
        if m:
            defaults.add(m.group(1))
            continue
        m = _DEFINE.match(line)
        if m and m.group(1) not in defaults:
            out[m.group(1)] = int(m.group(2))
    return out


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

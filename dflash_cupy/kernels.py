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

from .backends import nvrtc_info
from .source_dir import CUDA_SRC

_cache: dict = {}


def compile_options(**defines) -> tuple[str, ...]:
    """``-DNAME=VALUE`` for each size (ints/floats/bools), sorted for stable cache keys."""
    opts = []
    for k in sorted(defines):
        if k.startswith("DFLASH_FAULT"):   # cuda_src's test-only fault macros: never from a launcher
            raise ValueError(f"compile-time define {k!r}: DFLASH_FAULT_* names are test-only fault injection "
                             f"(tests/test_selfcheck_faults.py), never a launcher's option")
        v = defines[k]
        if isinstance(v, bool):
            v = int(v)
        if not isinstance(v, (int, float)):
            raise TypeError(f"compile-time size {k}={v!r} must be an int, float or bool")
        opts.append(f"-D{k}={v}")
    return ("-I" + str(CUDA_SRC),) + tuple(opts)


_NEEDS = re.compile(r"sm_(\d{2,3})(a?)")


def _compute_capability(device) -> str:
    """``device`` as a compute-capability string ("90"): a backend (the CUDA backend asks
    CuPy; a backend that models a device states its ``compute_capability``), a
    ``cupy.cuda.Device``, "90"/"sm_90"/90/(9, 0), or None (CuPy's current device)."""
    if device is None or getattr(device, "name", None) == "cuda":
        import cupy
        return str(cupy.cuda.Device().compute_capability)
    cc = getattr(device, "compute_capability", device)
    if isinstance(cc, tuple) and len(cc) == 2:
        return f"{int(cc[0])}{int(cc[1])}"
    if isinstance(cc, int) and not isinstance(cc, bool):
        return str(cc)
    if isinstance(cc, str) and re.fullmatch(r"(sm_)?\d{2,3}", cc):
        return cc.removeprefix("sm_")
    raise TypeError(f"device must be a backend, a cupy.cuda.Device, a compute capability "
                    f"('90', 90, (9, 0)) or None, got {device!r}")


def arch_options(device=None, needs: str = "sm_90a") -> tuple[str, ...]:
    """NVRTC options that build a kernel needing ``needs`` for ``device`` (see
    ``_compute_capability``), for ``backend.compile`` / ``cupy.RawModule(options=...)``.

    CuPy always appends its own ``-arch=sm_<cc>`` for the device (cupy/cuda/compiler.py,
    ``_get_arch_for_options_for_nvrtc``; it cannot name an ``a`` target itself). NVRTC
    (12.9 measured, tests/test_wgmma.py) keeps the arch-specific ``a`` of an earlier
    ``-arch=sm_90a`` when a later ``-arch`` names the same compute capability, so
    ``("-arch=sm_90a",)`` plus CuPy's ``-arch=sm_90`` yields an sm_90a cubin. Arch-specific
    (``a``) code runs only on that exact compute capability, so any other device raises
    ``RuntimeError`` here rather than failing later in ptxas or at load. A plain ``sm_XY``
    need only checks the device is at least XY (CuPy's own flag suffices)."""
    m = _NEEDS.fullmatch(needs) if isinstance(needs, str) else None
    if m is None:
        raise ValueError(f"needs must name a target like 'sm_90a' or 'sm_80', got {needs!r}")
    cc = _compute_capability(device)
    want, specific = m.group(1), bool(m.group(2))
    if specific and cc != want:
        raise RuntimeError(f"kernel needs {needs} (arch-specific instructions such as wgmma), which runs "
                           f"only on compute capability {want[:-1]}.{want[-1]}; the device has "
                           f"{cc[:-1]}.{cc[-1]}")
    if not specific and int(cc) < int(want):
        raise RuntimeError(f"kernel needs {needs}; the device has compute capability {cc[:-1]}.{cc[-1]}")
    return (f"-arch={needs}",) if specific else ()


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
    path = source_path(filename)
    source = path.read_text()
    opts = compile_options(**defines)
    needs = nvrtc_info.declared_arch(source)  # "// nvrtc-arch: sm_90a" (wgmma kernels)
    if needs:
        opts += arch_options(backend, needs)
    key = (id(backend), filename, opts)
    mod = _cache.get(key)
    if mod is None:
        mod = backend.compile(source, opts, filename=str(path))
        _cache[key] = mod
    return mod

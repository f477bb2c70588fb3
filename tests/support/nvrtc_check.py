"""NVRTC checks of a kernel source (``tests/test_nvrtc.py`` and the kernel tests that
bound registers): compile with the CUDA backend's flags, fail on an error, a warning,
a spill or a serialised wgmma; the option sets a source asks to be checked with."""
from __future__ import annotations

import re
import shlex

from dflash_cupy import kernels
from dflash_cupy.backends import nvrtc_info
from dflash_cupy.backends.nvrtc_info import parse_ptxas

ARCHS = ("sm_80", "sm_90")
CHECK_RE = re.compile(r"^\s*//\s*nvrtc-check:(.*)$", re.M)
# ptxas reports wgmma serialization (C7515: every wgmma waits for the previous one, losing the
# asynchrony the kernel is built on) as "info", not as a warning: caught as one.
WARNING_RE = re.compile(r"\bwarning\b", re.I)
SERIALIZED_RE = re.compile(r"Potential Performance Loss", re.I)
SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class NvrtcCheckFailed(AssertionError):
    pass


def archs_for(source: str) -> tuple[str, ...]:
    """The targets a source is checked for: its ``// nvrtc-arch:`` line, else ``ARCHS``."""
    arch = nvrtc_info.declared_arch(source)
    return (arch,) if arch else ARCHS


def option_sets(source: str, filename: str | None = None) -> list[tuple[str, ...]]:
    """The default option set () plus one per ``// nvrtc-check:`` line, plus (a GEMM kernel
    ``filename``) the options of the variants ``tests/support/gemm_variants.py`` lists."""
    from tests.support import gemm_variants
    sets: list[tuple[str, ...]] = [()]
    found = [tuple(shlex.split(m.group(1))) for m in CHECK_RE.finditer(source)]
    for opts in found + (gemm_variants.option_sets(filename) if filename else []):
        if opts and opts not in sets:
            sets.append(opts)
    return sets


def nvrtc_check(source: str, filename: str, arch: str, options=(), serialized_ok: bool = False) -> dict[str, dict[str, int]]:
    """Compile with NVRTC (``nvrtc_info.cached_compile_info``: the CUDA backend's flags;
    the log of the same compile the emulator and the other tests ask for, kept on disk
    by source, options, headers, target and NVRTC version); raise ``NvrtcCheckFailed``
    (naming ``filename``) on an error, a warning, a spill or (unless ``serialized_ok``:
    a test kernel that reads accumulators early on purpose) wgmma serialization.
    Returns ``parse_ptxas`` of the log."""
    where = f"{filename} [{arch} {' '.join(options)}]"
    try:
        info = nvrtc_info.cached_compile_info(source, filename, (*kernels.compile_options(), *options), arch)
    except nvrtc_info.NvrtcCompileError as e:
        raise NvrtcCheckFailed(f"{where}: {e}") from None
    log = info.log
    if WARNING_RE.search(log) or (not serialized_ok and SERIALIZED_RE.search(log)):
        raise NvrtcCheckFailed(f"{where}: compiler warnings:\n{log}")
    for m in SPILL_RE.finditer(log):
        if int(m.group(1)) or int(m.group(2)):
            raise NvrtcCheckFailed(f"{where}: register spills:\n{log}")
    return parse_ptxas(log)

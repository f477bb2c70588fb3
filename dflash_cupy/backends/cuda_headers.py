"""Where the CUDA runtime headers NVRTC compiles against (``cuda_fp16.h``,
``cuda_bf16.h``, ...) are on this machine.

``cuda.pathfinder`` (installed with CuPy) does the search: NVIDIA wheels
(CUDA 13 puts every toolkit header in ``nvidia/cu13/include``, CUDA 12 in
per-component ``nvidia/cuda_runtime/include``), conda, ``CUDA_PATH`` /
``CUDA_HOME`` and the system directories. What is kept here is the one check
it does not make: the headers' major version must be NVRTC's, because CuPy
adds its own include directories after ours and a mismatched directory here
would shadow a correct one there. CuPy's own notion of the CUDA root is the
fallback where pathfinder is absent or finds only another major version.
"""
from __future__ import annotations

import functools
import re
from pathlib import Path

_CUDART_VERSION_RE = re.compile(r"#define\s+CUDART_VERSION\s+(\d+)")


def header_major(d: Path) -> int | None:
    """The CUDA major version of the runtime headers in ``d`` (None: not readable)."""
    try:
        text = (Path(d) / "cuda_runtime_api.h").read_text(errors="replace")
    except OSError:
        return None
    m = _CUDART_VERSION_RE.search(text)
    return int(m.group(1)) // 1000 if m else None


def _candidates() -> list[Path]:
    out: list[Path] = []
    try:
        from cuda.pathfinder import find_nvidia_header_directory
        found = find_nvidia_header_directory("cudart")
        if found:
            out.append(Path(found))
    except Exception:  # not installed, or a version whose search raised
        pass
    try:
        import cupy
        root = cupy.cuda.get_cuda_path()
        if root:
            out.append(Path(root) / "include")
    except Exception:
        pass
    return out


@functools.lru_cache(maxsize=None)
def cuda_include_dirs(nvrtc_major: int | None) -> tuple[str, ...]:
    """The runtime header directory for NVRTC of major version ``nvrtc_major``,
    as a 0- or 1-tuple (None: NVRTC's version is unknown, take the first found)."""
    for d in _candidates():
        if not (d / "cuda_fp16.h").is_file():
            continue
        hm = header_major(d)
        if nvrtc_major is None or hm is None or hm == nvrtc_major:
            return (str(d),)
    return ()

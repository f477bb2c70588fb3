"""The CuPy backend's own logic (compile options and #line, argument checks,
launch shape checks, streams and shared-memory attribute, pinned buffers and the
driver's pinned query, capture guard and
allocator restore, copy validation, the current stream and ``with stream:``,
``to_numpy`` on a stream) against faked CUDA calls, so CI covers
``backends/cuda.py`` without a GPU. The harness monkeypatches CuPy process-wide,
hence the subprocess. Header discovery (``cuda_headers``) is tested directly."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).parent / "support" / "fake_cuda_harness.py"


def test_cuda_backend_logic_with_faked_cuda():
    pytest.importorskip("cupy")
    root = Path(__file__).resolve().parent.parent
    # this checkout's package, not whichever one the interpreter has installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    r = subprocess.run([sys.executable, str(HARNESS)], capture_output=True, text=True, timeout=300,
                       cwd=root, env=env)
    assert r.returncode == 0 and "harness OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def _headers(d: Path, cudart_version: int | None, fp16: bool = True) -> Path:
    d.mkdir(parents=True)
    if fp16:
        (d / "cuda_fp16.h").write_text("// fp16\n")
    if cudart_version is not None:
        (d / "cuda_runtime_api.h").write_text(f"#define CUDART_VERSION {cudart_version}\n")
    return d


def test_cuda_headers_match_nvrtc_major(tmp_path, monkeypatch):
    from dflash_cupy.backends import cuda_headers
    no_fp16 = _headers(tmp_path / "partial", 13000, fp16=False)
    cu12 = _headers(tmp_path / "cu12", 12080)
    cu13 = _headers(tmp_path / "cu13", 13000)
    unknown = _headers(tmp_path / "unknown", None)
    monkeypatch.setattr(cuda_headers, "_candidates", lambda: [no_fp16, cu12, cu13])
    cuda_headers.cuda_include_dirs.cache_clear()
    try:
        assert cuda_headers.header_major(cu12) == 12 and cuda_headers.header_major(unknown) is None
        assert cuda_headers.cuda_include_dirs(13) == (str(cu13),)   # a cu12 dir would shadow CuPy's
        assert cuda_headers.cuda_include_dirs(12) == (str(cu12),)
        assert cuda_headers.cuda_include_dirs(None) == (str(cu12),)  # NVRTC unknown: the first usable
        assert cuda_headers.cuda_include_dirs(11) == ()               # CuPy's own dirs then serve
        monkeypatch.setattr(cuda_headers, "_candidates", lambda: [unknown])
        cuda_headers.cuda_include_dirs.cache_clear()
        assert cuda_headers.cuda_include_dirs(13) == (str(unknown),)  # no version to refuse it by
    finally:
        cuda_headers.cuda_include_dirs.cache_clear()


def test_cuda_headers_found_by_pathfinder_here():
    pytest.importorskip("cuda.pathfinder")
    from cuda.pathfinder import find_nvidia_header_directory
    from dflash_cupy.backends import cuda_headers, nvrtc_info
    found = find_nvidia_header_directory("cudart")
    if found is None:
        pytest.skip("no CUDA runtime headers installed")
    assert str(Path(found)) in map(str, cuda_headers._candidates())
    try:
        major = nvrtc_info.nvrtc_version()[0]
    except nvrtc_info.NvrtcUnavailable:
        pytest.skip("NVRTC cannot be loaded")
    if cuda_headers.header_major(Path(found)) == major:
        assert nvrtc_info.cuda_header_dirs() == (str(Path(found)),)

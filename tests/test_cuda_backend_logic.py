"""The CuPy backend's own logic (compile options and #line, argument checks,
launch streams and shared-memory attribute, pinned registry, capture guard and
allocator restore, copy validation, the current stream and ``with stream:``,
``to_numpy`` on a stream) against faked CUDA calls, so CI covers
``backends/cuda.py`` without a GPU. The harness monkeypatches CuPy process-wide,
hence the subprocess."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("fake_cuda_harness.py")


def test_cuda_backend_logic_with_faked_cuda():
    pytest.importorskip("cupy")
    root = HARNESS.parent.parent
    # this checkout's package, not whichever one the interpreter has installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    r = subprocess.run([sys.executable, str(HARNESS)], capture_output=True, text=True, timeout=300,
                       cwd=root, env=env)
    assert r.returncode == 0 and "harness OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]

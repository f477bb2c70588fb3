"""Memory an emulated module costs the process: a worker loads hundreds of kernel
variants, and each OS thread keeps the TLS block of every module it ran. The
``extern __shared__`` arrays (SMEM_BYTES each) live in one library per name
(``emu.build.dynamic_shared``), not in each module's TLS; a CI worker grew to
10 GB when they did."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dflash_cupy.emu import build as emu_build

ROOT = Path(__file__).resolve().parent.parent

SRC = r"""
extern "C" __global__ void shuffle(float* out, int n) {
    extern __shared__ float sm[];
    __shared__ float st[64];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    sm[threadIdx.x] = (float)(VARIANT + threadIdx.x);
    if (threadIdx.x < 64) st[threadIdx.x] = 1.0f;
    __syncthreads();
    if (i < n) out[i] = sm[blockDim.x - 1 - threadIdx.x] + st[threadIdx.x % 64];
}
"""

# One fresh process: 8 variants to warm up, then N more, each built, loaded, launched on
# two OS threads (64 blocks) and dropped; prints the RSS growth per module in KB.
CHILD = textwrap.dedent("""
    import gc, sys
    import numpy as np
    from dflash_cupy.emu.backend import EmulatedBackend
    def rss_kb():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
    src, n, base = open(sys.argv[1]).read(), int(sys.argv[2]), int(sys.argv[3])
    be = EmulatedBackend()
    out = be.zeros((64 * 128,), np.float32)
    def one(v):
        m = be.compile(src, ["-DVARIANT=%d" % v], "module_memory.cu")
        m.get_function("shuffle")((64,), (128,), (out, np.int32(64 * 128)), shared_mem=128 * 4)
        got = be.to_numpy(out)[:128]
        want = v + 127 - np.arange(128, dtype=np.float32) + 1
        assert np.array_equal(got, want), (v, got[:4], want[:4])
    for v in range(base, base + 8):
        one(v)
    gc.collect()
    r0 = rss_kb()
    for v in range(base + 8, base + 8 + n):
        one(v)
    gc.collect()
    print((rss_kb() - r0) / n)
""")


def test_rss_per_loaded_then_dropped_module_is_bounded(tmp_path):
    src = tmp_path / "module_memory.cu"
    src.write_text(SRC)
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_CUPY_EMU_THREADS": "2", "DFLASH_CUPY_EMU_LAZY": "1"}
    n = 30
    r = subprocess.run([sys.executable, str(child), str(src), str(n), "7100"], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    per_module_kb = float(r.stdout.split()[-1])
    # Before: ~640 KB (SMEM_BYTES of TLS per thread and module); now ~60 KB (the mapping,
    # the static __shared__ array, ctypes' objects). The bound is far from both.
    assert per_module_kb < 200, f"{per_module_kb:.0f} KB of RSS per emulated module"


def _tls_bytes(so: Path) -> int:
    r = subprocess.run(["readelf", "-lW", str(so)], capture_output=True, text=True, check=True)
    return sum(int(line.split()[5], 16) for line in r.stdout.splitlines() if line.split()[:1] == ["TLS"])


def test_a_module_carries_no_extern_shared_arena_and_modules_share_one_per_name():
    so_a, _ = emu_build.build(SRC, ("-DVARIANT=1",), "module_memory.cu")
    so_b, _ = emu_build.build(SRC, ("-DVARIANT=2",), "module_memory.cu")
    assert so_a != so_b
    for so in (so_a, so_b):
        # its own TLS: the static __shared__ array and the anchor, not SMEM_BYTES
        assert 64 * 4 <= _tls_bytes(so) < 4096
    lib = emu_build.dynamic_shared("sm")
    assert _tls_bytes(lib) >= emu_build.SMEM_BYTES
    for so in (so_a, so_b):
        needed = subprocess.run(["readelf", "-dW", str(so)], capture_output=True, text=True, check=True).stdout
        assert str(lib) in needed


def test_two_modules_sharing_an_extern_shared_name_each_see_their_own_block_data(emu):
    # Interleaved launches of two modules on one stream: each block is poisoned and
    # written before it reads, so sharing the arena per name changes no result.
    out = emu.zeros((4 * 128,), np.float32)
    mods = [emu.compile(SRC, (f"-DVARIANT={v}",), "module_memory.cu").get_function("shuffle")
            for v in (11, 23)]
    for rep in range(3):
        for v, k in zip((11, 23), mods):
            k((4,), (128,), (out, np.int32(4 * 128)), shared_mem=128 * 4)
            got = emu.to_numpy(out)
            want = np.tile(v + 127 - np.arange(128, dtype=np.float32) + 1, 4)
            np.testing.assert_array_equal(got, want)


def test_a_bad_extern_shared_name_is_refused():
    with pytest.raises(emu_build.CompileError, match="not an identifier"):
        emu_build.dynamic_shared("a;b")

"""The CPU/GPU differential (``emu/differential_backend.py``, ``tests/support/differential_mode.py``).

Its comparison runs here on the CPU with a second emulator as the reference
(another fiber schedule and seed): real product kernels must agree bit for
bit, a schedule-dependent (racy) kernel must be caught, a difference within
tolerance passes but is tallied as not bit-identical, aliasing views of one
allocation alias on the reference too. The GPU run itself is
``DFLASH_CUPY_DIFFERENTIAL=1 pytest -k emulated`` (``profiling/gpu_check.sh``).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.backends.base import KernelLaunchError
from dflash_cupy.emu.differential_backend import DifferentialBackend, DifferentialMismatch
from dflash_cupy.emu.backend import EmulatedBackend

ROOT = Path(__file__).resolve().parent.parent

RACY = r"""
// Every thread writes y[0] with no ordering: the last writer wins, and which one is last
// depends on the schedule. (A bug on a GPU too; here it makes two emulators disagree.)
extern "C" __global__ void last_writer_f(float* y, float step) { y[0] = 1.0f + step * (float)threadIdx.x; }
extern "C" __global__ void last_writer_i(int* y) { y[0] = (int)threadIdx.x; }
extern "C" __global__ void alias_probe(const float* a, float* b) {
    // With a == b, the read sees the write: 5, 5. Separate copies would give 5, a[0].
    b[0] = 5.0f;
    b[1] = a[0];
}
extern "C" __global__ void scale(const float* x, float* y, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * s;
}
"""


def _reversed_emulator(seed: int = 7) -> EmulatedBackend:
    ref = EmulatedBackend()
    ref.schedule = "reverse"   # against the default shuffled schedule of the tested one
    ref.seed = seed
    return ref


@pytest.fixture
def diff():
    be = DifferentialBackend(_reversed_emulator())
    be.schedule = "forward"
    return be


def test_product_kernels_agree_bit_for_bit(diff, rng):
    from dflash_cupy.ops.norm import RmsNorm, rmsnorm_reference
    x = rng.standard_normal((5, 256)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    xd, wd, yd = diff.asarray(x), diff.asarray(w), diff.zeros((5, 256), np.float32)
    RmsNorm(diff, 256)(xd, wd, yd)
    assert np.allclose(diff.to_numpy(yd), rmsnorm_reference(x, w), atol=1e-5, rtol=1e-5)
    st = diff.stats.kernels
    assert sum(s.launches for s in st.values()) >= 1
    assert all(s.bit_identical == s.launches for s in st.values()), diff.stats.report()
    assert diff.stats.mismatches == []


def test_racy_kernel_is_caught(diff):
    mod = diff.compile(RACY, (), filename="racy.cu")
    y = diff.zeros(1, np.int32)
    with pytest.raises(DifferentialMismatch, match=r"last_writer_i .*argument y \(int32\[1\]\) is not "
                                                   r"bit-identical: 1 element\(s\) differ"):
        mod.get_function("last_writer_i")(1, 64, (y,))
    yf = diff.zeros(1, np.float32)
    with pytest.raises(DifferentialMismatch, match=r"last_writer_f .*beyond the f32 tolerance"):
        mod.get_function("last_writer_f")(1, 64, (yf, np.float32(1.0)))
    assert len(diff.stats.mismatches) == 2
    assert "2 mismatching launch(es)" in diff.stats.report()


def test_difference_within_tolerance_passes_but_is_not_bit_identical(diff):
    mod = diff.compile(RACY, (), filename="racy.cu")
    k = mod.get_function("last_writer_f")
    y = diff.zeros(1, np.float32)
    k(1, 32, (y, np.float32(1e-7)))  # 31 ulps-ish apart at most: inside f32 atol + rtol
    s = diff.stats.kernels["last_writer_f"]
    assert s.launches == 1 and s.bit_identical == 0 and 0 < s.worst_abs_err < 1e-5
    assert s.worst_arg.startswith("y (float32")
    strict = DifferentialBackend(_reversed_emulator(), exact=True)
    strict.schedule = "forward"
    with pytest.raises(DifferentialMismatch, match="not bit-identical"):
        strict.compile(RACY, (), filename="racy.cu").get_function("last_writer_f")(
            1, 32, (strict.zeros(1, np.float32), np.float32(1e-7)))


def test_views_of_one_allocation_alias_on_the_reference(diff):
    mod = diff.compile(RACY, (), filename="racy.cu")
    buf = diff.asarray(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
    mod.get_function("alias_probe")(1, 1, (buf, buf))
    assert diff.to_numpy(buf).tolist() == [5.0, 5.0, 3.0, 4.0]
    # Offset views into one allocation: the reference writes the same bytes.
    big = diff.asarray(np.arange(64, dtype=np.float32))
    mod.get_function("scale")(1, 32, (big[:32], big[32:], np.float32(2.0), np.int32(32)))
    assert diff.to_numpy(big)[32:].tolist() == [2.0 * i for i in range(32)]
    st = diff.stats.kernels
    assert st["alias_probe"].bit_identical == 1 and st["scale"].bit_identical == 1


def test_reference_refusing_a_launch_is_a_mismatch(diff):
    class Refusing(EmulatedBackend):
        def compile(self, source, options=(), filename=None):
            mod = super().compile(source, options, filename)

            class K:
                def __call__(self, *a, **k):
                    raise KernelLaunchError("refused by the reference")

            mod.get_function = lambda name: K()
            return mod

    be = DifferentialBackend(Refusing())
    k = be.compile(RACY, (), filename="racy.cu").get_function("scale")
    x = be.zeros(4, np.float32)
    with pytest.raises(DifferentialMismatch, match="emulator ran it but the emulated backend failed"):
        k(1, 4, (x, x, np.float32(1.0), np.int32(4)))


def test_capture_is_not_compared(diff):
    mod = diff.compile(RACY, (), filename="racy.cu")
    s = diff.stream()
    y = diff.zeros(1, np.int32)
    diff.synchronize()  # zeros memset on the current stream; the graph writes y on s
    diff.begin_capture(s)
    mod.get_function("last_writer_i")(1, 64, (y,), stream=s)
    g = diff.end_capture(s)
    g.launch(s)
    assert "last_writer_i" not in diff.stats.kernels


def test_differential_mode_without_gpu_skips_with_reason(tmp_path):
    if backends.gpu_available():
        pytest.skip("a GPU is visible: the mode runs for real (profiling/gpu_check.sh)")
    env = dict(os.environ, DFLASH_CUPY_DIFFERENTIAL="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                        "tests/test_config.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "skipped" in p.stdout and "passed" not in p.stdout
    assert "DFLASH_CUPY_DIFFERENTIAL: the CPU/GPU differential compares the emulator against a GPU" \
        in p.stdout


@pytest.mark.skipif(not backends.gpu_available(), reason="needs a GPU (the CuPy backend as the reference)")
def test_emulator_agrees_with_the_gpu_on_rmsnorm(rng):
    from dflash_cupy.ops.norm import RmsNorm
    be = DifferentialBackend(backends.get("cuda"))
    x = rng.standard_normal((5, 256)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, 256).astype(np.float32)
    RmsNorm(be, 256)(be.asarray(x), be.asarray(w), be.zeros((5, 256), np.float32))
    assert be.stats.mismatches == [] and be.stats.kernels
    print(be.stats.report())


def test_parallel_runner_reports_each_file_and_its_table(capsys):
    from profiling import run_differential
    rc = run_differential.main(["--mode", "emulated", "tests/test_norm.py", "tests/test_plan.py", "--",
                            "-k", "emulated and (test_rows_are_D_wide_slices_of_the_last_axis or test_masks_exact)"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert out.index("differential tests/test_norm.py: rc=0") < out.index("differential tests/test_plan.py: rc=0")
    assert "CPU/GPU differential (emulated vs emulated)" in out and "rmsnorm" in out and "build_masks" in out
    assert "0 mismatching launch(es)" in out and "2/2 files passed" in out
    # A failing file fails the run (here: a selection that collects nothing, pytest rc 5).
    assert run_differential.main(["--mode", "emulated", "tests/test_norm.py", "--", "-k", "no_such_test"]) == 1


def test_exact_kernel_table_names_real_kernels():
    from dflash_cupy import kernels
    from dflash_cupy.emu import build as emu_build
    from dflash_cupy.emu import differential_backend as differential
    files = [*kernels.CUDA_SRC.glob("*.cu"), Path(__file__).resolve().parent / "cuda" / "planning_unfused.cu"]
    names = {k.name for f in files for k in emu_build.parse_kernels(f.read_text())}
    assert differential.EXACT_KERNELS <= names, differential.EXACT_KERNELS - names
    assert set(differential.KERNEL_TOLERANCE) <= names


def test_parallel_runner_deadline_keeps_partial_output(capsys):
    from profiling import run_differential
    rc = run_differential.main(["--mode", "emulated", "--timeout-s", "0.5", "tests/test_norm.py"])
    out = capsys.readouterr().out
    assert rc == 1 and "rc=124" in out and "killed at the runner's --timeout-s" in out

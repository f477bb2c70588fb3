"""Shared fixtures: every kernel test runs on the emulated backend always, and
on the CuPy backend as well when a GPU is visible. Helpers shared by several
test modules live in ``tests/support/``; test modules never import each other."""
import os

import numpy as np
import pytest

# The emulator's strict settings are its defaults; tests pin them so that a
# developer's environment (e.g. DFLASH_CUPY_EMU_CHECKS=0 for speed) cannot
# quietly weaken them: memory checks compiled in, empty() poisoned.
os.environ["DFLASH_CUPY_EMU_CHECKS"] = "1"
os.environ["DFLASH_CUPY_EMU_POISON"] = "1"
# Modules build at their first launch (the emulated backend's lazy mode): the many
# variants a cache or a Gemm compiles but a test never launches cost no g++ or NVRTC
# run. Tests of what compile() itself rejects are marked eager_build;
# DFLASH_CUPY_EMU_LAZY=0 builds every compiled variant, as a program does by default.
os.environ.setdefault("DFLASH_CUPY_EMU_LAZY", "1")


def _fixed_mmap_threshold(nbytes: int = 1 << 20) -> None:
    """glibc's malloc raises its mmap threshold (up to 32 MB) each time a large block is
    freed; from then on calloc (np.zeros) hands out reused heap memory and must write zeros
    into all of it. The cost model's traces allocate GBs of zeros they never touch: a worker
    grows past 10 GB and spends its time zeroing. A fixed threshold keeps every block from
    ``nbytes`` up in fresh mappings, untouched pages costing nothing."""
    import ctypes
    try:
        ctypes.CDLL(None).mallopt(-3, nbytes)   # M_MMAP_THRESHOLD (glibc; elsewhere absent)
    except (OSError, AttributeError):
        pass


_fixed_mmap_threshold()

from hypothesis import settings

from dflash_cupy import backends

# Every random draw is seeded, hypothesis's too: the same examples on every run and
# every machine (CI included), so a failure reproduces and the measured-error ceilings
# of test_kv_cache are facts of the code, not of a run. HYPOTHESIS_PROFILE=explore
# draws fresh examples for a developer hunting bugs.
settings.register_profile("seeded", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seeded"))

from .support import differential_mode  # noqa: E402
from .support.differential_mode import pytest_addoption, pytest_configure  # noqa: F401,E402
from .support.model_params import goal_lines, pin_model_parameters  # noqa: F401,E402 (an autouse fixture)

BACKEND_NAMES = ["emulated"] + (["cuda"] if backends.gpu_available() else [])


def pytest_collection_modifyitems(config, items):
    differential_mode.pytest_collection_modifyitems(config, items)
    # Long tests first (stable otherwise): with parallel workers (-n) a long test
    # started last would leave the other workers idle at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    differential_mode.pytest_terminal_summary(terminalreporter, exitstatus, config)
    lines = goal_lines(r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, ()))
    if lines:   # model outputs measured against the project's goals: reported, not asserted
        terminalreporter.write_sep("=", "model goals (pinned parameters)")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: the CPUs this process may run on, bounded by a cgroup CPU quota
    (a container's 2 CPUs on a 64-core host are 2 workers, not 64)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        if quota != "max":
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


@pytest.fixture(params=BACKEND_NAMES)
def backend(request):
    return backends.get(request.param)


@pytest.fixture
def emu():
    return backends.get("emulated")


@pytest.fixture
def rng(request):
    # Seeded from the test's name, so each test draws the same data on every run.
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _eager_build(request, monkeypatch):
    """``@pytest.mark.eager_build``: this test's emulated compiles build at once (it
    checks what compile() rejects)."""
    if request.node.get_closest_marker("eager_build") is not None:
        monkeypatch.setenv("DFLASH_CUPY_EMU_LAZY", "0")
        be = backends._instances.get("emulated")
        if be is not None and hasattr(be, "lazy"):
            monkeypatch.setattr(be, "lazy", False)


@pytest.fixture(autouse=True)
def _drain_emulated_streams():
    """Emulated stream work runs when waited for: wait at the end of each test,
    so work a test left queued (and any error it raises) is that test's."""
    yield
    be = backends._instances.get("emulated")
    if be is not None and not be.is_capturing():
        be.synchronize()


def _glibc_malloc_trim():
    import ctypes
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):   # not glibc: nothing to hand back this way
        return None


_malloc_trim = _glibc_malloc_trim()


def pytest_runtest_logfinish(nodeid, location):
    """After each test (its fixtures torn down), hand the heap it freed back to the OS:
    glibc raises its mmap threshold after a large free, so later large arrays come from
    the heap and stay counted in RSS when freed. A worker kept ~1 GB per model-trace test
    this way (an xdist worker of .ci/run was OOM-killed at 10.6 GB)."""
    if _malloc_trim is not None:
        _malloc_trim(0)


@pytest.fixture
def verdicts(monkeypatch, tmp_path):
    """A private self-check verdict file, auto mode, nothing known in memory (before and
    after): tests/test_selfcheck*.py."""
    from dflash_cupy import selfcheck_verdict as sv
    monkeypatch.setenv(sv.ENV_CACHE, str(tmp_path / "selfcheck.json"))
    monkeypatch.setenv(sv.ENV_MODE, "auto")
    sv.forget()
    yield tmp_path / "selfcheck.json"
    sv.forget()

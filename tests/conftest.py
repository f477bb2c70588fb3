"""Shared fixtures: every kernel test runs on the emulated backend always, and
on the CuPy backend as well when a GPU is visible."""
import os

import numpy as np
import pytest

# The emulator's strict settings are its defaults; tests pin them so that a
# developer's environment (e.g. DFLASH_CUPY_EMU_CHECKS=0 for speed) cannot
# quietly weaken them: memory checks compiled in, empty() poisoned.
os.environ["DFLASH_CUPY_EMU_CHECKS"] = "1"
os.environ["DFLASH_CUPY_EMU_POISON"] = "1"

from hypothesis import settings

from dflash_cupy import backends

# Every random draw is seeded, hypothesis's too: the same examples on every run and
# every machine (CI included), so a failure reproduces and the measured-error ceilings
# of test_kv_cache are facts of the code, not of a run. HYPOTHESIS_PROFILE=explore
# draws fresh examples for a developer hunting bugs.
settings.register_profile("seeded", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seeded"))

from .differential import (pytest_addoption, pytest_collection_modifyitems,  # noqa: F401
                           pytest_configure, pytest_terminal_summary)

BACKEND_NAMES = ["emulated"] + (["cuda"] if backends.gpu_available() else [])


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
def _drain_emulated_streams():
    """Emulated stream work runs when waited for: wait at the end of each test,
    so work a test left queued (and any error it raises) is that test's."""
    yield
    be = backends._instances.get("emulated")
    if be is not None and not be.is_capturing():
        be.synchronize()

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

from dflash_cupy import backends

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

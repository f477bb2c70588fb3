"""Differential test mode (pytest hooks, imported by ``tests/conftest.py``).

``DFLASH_CUPY_DIFFERENTIAL=1 pytest ... -k emulated`` (or ``--differential``)
replaces the process-wide emulated backend by a ``DifferentialBackend`` whose
reference is the CuPy backend: every kernel test's eager launches then run on
both, and a disagreement beyond the kernel's tolerance fails the test that
made it (``DFLASH_CUPY_DIFFERENTIAL=exact``: bit for bit everywhere). The
per-kernel tally (launches, bit-identical ones, worst error) is printed at
the end. Without a GPU every test is skipped with the reason.
``DFLASH_CUPY_DIFFERENTIAL=emulated`` runs the same machinery on the CPU with a
second emulator (reverse fiber schedule) as the reference.
"""
from __future__ import annotations

import os

import pytest

from dflash_cupy import backends

ENV_VAR = "DFLASH_CUPY_DIFFERENTIAL"


def pytest_addoption(parser):
    parser.addoption("--differential", action="store_true", default=False,
                     help="run every emulated launch on the CuPy backend too and compare "
                          f"(same as {ENV_VAR}=1; needs a GPU)")


def mode(config) -> str | None:
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env not in ("", "0", "1", "exact", "emulated"):
        raise pytest.UsageError(f"{ENV_VAR}={env!r}: expected 0, 1, exact or emulated")
    if env in ("1", "exact", "emulated"):
        return env
    return "1" if config.getoption("--differential") else None


def pytest_configure(config):
    m = mode(config)
    if m is None:
        return
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None) not in (None, 0):
        # each worker would hold its own backend and tally, and none would reach the summary
        raise pytest.UsageError(f"{ENV_VAR}: the differential runs in one process; add -n 0")
    from dflash_cupy.emu.differential_backend import DifferentialBackend
    if m == "emulated":  # the machinery on the CPU: a second emulator, reverse schedule, as reference
        from dflash_cupy.emu.backend import EmulatedBackend
        ref = EmulatedBackend()
        ref.schedule, ref.seed = "reverse", ref.seed + 1
        be = DifferentialBackend(ref)
        backends._instances["emulated"] = be
        config._dflash_differential = be
        return
    if not backends.gpu_available():
        config._dflash_differential_skip = (f"{ENV_VAR}: the CPU/GPU differential compares the "
                                            "emulator against a GPU, and CuPy sees none")
        return
    be = DifferentialBackend(backends.get("cuda"), exact=(m == "exact"))
    backends._instances["emulated"] = be
    config._dflash_differential = be


def pytest_collection_modifyitems(config, items):
    reason = getattr(config, "_dflash_differential_skip", None)
    if reason:
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    be = getattr(config, "_dflash_differential", None)
    if be is not None:
        terminalreporter.write_sep("=", f"CPU/GPU differential (emulated vs {be.reference.name})")
        terminalreporter.write_line(be.stats.report())

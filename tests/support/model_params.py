"""The cost-model tests' parameter set, pinned, and their goal reports.

Pinned: the tests model the published parameter set of ``profiling/hw_params.py``
(``GPUS``); a calibration file a GPU run wrote to ``profiling/results/`` does not
change what they compute (``pin_model_parameters`` points ``get_gpu``'s default
calibration file at a path that never exists). ``get_gpu(name, path)`` with an
explicit file still applies it (the calibration tests).

Goals: a model output that is a goal of the project (an issue's bar, a
before/after figure) is reported with ``report_goal`` and listed at the end of
the run ("model goals"), not asserted; the tests assert the model's mechanics.
"""
from __future__ import annotations

from pathlib import Path

import pytest

NO_CALIBRATION = Path(__file__).with_name("no_calibration_file.json")   # never created


@pytest.fixture(autouse=True, scope="session")
def pin_model_parameters():
    from profiling import hw_params
    assert not NO_CALIBRATION.exists(), NO_CALIBRATION
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hw_params, "CALIBRATION_FILE", NO_CALIBRATION)
        yield


GOAL_KEY = "model goal"


def report_goal(request, what: str, value: float, goal: str, met: bool) -> None:
    """Record a model output against its goal on the test's report (shown at the end
    of the run, also from pytest-xdist workers)."""
    request.node.user_properties.append((GOAL_KEY, f"{what}: {value:.4g} ({goal}: {'met' if met else 'NOT met'})"))


def goal_lines(reports) -> list[str]:
    """The recorded goals of ``reports`` (test reports of the run), in test order."""
    out = []
    for r in reports:
        if getattr(r, "when", None) != "call":
            continue
        out += [f"{r.nodeid.split('::')[-1]}: {v}" for k, v in getattr(r, "user_properties", ()) if k == GOAL_KEY]
    return out

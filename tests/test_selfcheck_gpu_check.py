"""profiling/gpu_check.sh and the self-check: the self-check runs first and its report is
written before anything else; ``--quick`` (self-check, differential, one step timing per
drafter preset) passes as a dry run on the CPU; a run killed after its first stage keeps
what it wrote (the full mode's dry run is tests/test_profiling.py's)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_cupy import backends

from tests.support.gpu_check_run import recorded_commands

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "profiling" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(backends.gpu_available(), reason="the CPU dry runs; a GPU machine runs the real check")


def _env():
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("DFLASH_CUPY_BACKEND", None)
    return env


def _selfcheck_report(out: Path) -> dict:
    d = json.loads((out / "selfcheck.json").read_text())
    assert d["passed"] and {d["status"][v] for v in ("plan", "norm", "rope", "sample")} == {"pass"}
    return d


def test_quick_dry_run(tmp_path):
    out = tmp_path / "quick"
    p = subprocess.run(["bash", str(SCRIPT), str(out), "--quick", "--dry-run"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=480)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    assert sorted(f.name for f in out.iterdir()) == ["bench.log", "gpu_check.log", "selfcheck.json", "step_quick.json",
                                                      "tests.log"]
    _selfcheck_report(out)
    log = (out / "gpu_check.log").read_text()
    # the self-check's report is in the log before any later step started; the steps of the
    # full mode did not run
    report_at = log.index("dflash_cupy self-check on")
    assert report_at < log.index("START differential") < log.index("START step_quick")
    for step in ("START tests", "START pdl", "START gemm", "START soak"):
        assert step not in log
    rows = json.loads((out / "step_quick.json").read_text())["rows"]
    assert {(r["drafter"], r["window"], r["mode"]) for r in rows} == {("tiny", 32, "graph"), ("tiny", 32, "kernels")}
    assert "FINISHED ok" in p.stdout


@pytest.mark.parametrize("mode", [[], ["--quick"]], ids=["full", "quick"])
def test_killed_after_the_first_stage_keeps_its_results(tmp_path, mode):
    out = tmp_path / "cut"
    proc = subprocess.Popen(["bash", str(SCRIPT), str(out), *mode, "--dry-run"], cwd=ROOT, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = out / "gpu_check.log"
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:
            if log.is_file() and "DONE selfcheck" in log.read_text():
                break
            if proc.poll() is not None:
                pytest.fail("gpu_check ended before its self-check did: " + proc.stdout.read()[-3000:])
            time.sleep(0.5)
        else:
            pytest.fail("the self-check stage did not end in time")
        time.sleep(1.0)                                   # the next stage has started
        os.killpg(proc.pid, signal.SIGTERM)               # what a device call's limit does
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc != 0
    _selfcheck_report(out)                                # complete JSON, written before the kill
    text = log.read_text()
    assert "dflash_cupy self-check on" in text and "INTERRUPTED during" in text
    assert "FINISHED" not in text


def test_quick_real_commands(tmp_path):
    """--quick's GPU command lines, recorded by a stand-in python: the whole self-check first,
    then the differential, then bench_step for both drafter presets with per-kernel times,
    nothing else; limits that fit 4 minutes."""
    cmds = recorded_commands(tmp_path, "--quick")
    assert cmds[0][:2] == ["-", "0"]                                  # preflight, real mode
    sc = cmds[1]
    assert sc[1:3] == ["dflash_cupy", "selfcheck"] and "--only" not in sc and sc[sc.index("--out") + 1].endswith(
        "/o/selfcheck.json")
    from profiling import bench_step, run_differential
    assert [c[1] for c in cmds[2:]] == ["profiling.run_differential", "profiling.bench_step", "profiling.summarize"]
    diff = run_differential.parse_args(cmds[2][2:])
    assert diff.timeout_s == 70 and "tests/test_attention.py" in diff.files
    step = bench_step.parse_args(cmds[3][2:])
    assert step.drafters == ["qwen3.5-27b", "h4096"] and step.windows == [4096] and step.modes == ["graph"]
    assert step.kernel_times == 3 and not step.smoke and step.out.endswith("/o/step_quick.json")
    log = (tmp_path / "o" / "gpu_check.log").read_text()
    assert "budget 235s" in log
    limits = [int(x) for x in __import__("re").findall(r"START \w+ \(timeout (\d+)s\)", log)]
    assert len(limits) == 3 and sum(limits) <= 235 - 10

"""Run the CPU/GPU differential over several test files at once.

    python -m profiling.run_differential [--mode 1|exact|emulated] [--jobs N] [--timeout-s S] FILE...
                                     [-- PYTEST_ARGS...]

One ``pytest`` per file, in parallel (the emulator's cold g++ builds dominate
a first run, and they are per process), each with
``DFLASH_CUPY_DIFFERENTIAL=<mode>`` (``tests/support/differential_mode.py``) and the
emulated backend as the default. The outputs are printed whole, file by file
in the given order, each ending with its per-kernel table. Exit status: 0 if
every file passed, else 1.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="python -m profiling.run_differential", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", help="test files (kernel-level tests)")
    p.add_argument("--mode", default="1", choices=("1", "exact", "emulated"),
                   help="DFLASH_CUPY_DIFFERENTIAL value (emulated: a second emulator as the reference)")
    p.add_argument("--jobs", type=int, default=0, help="parallel pytest processes (default: one per file, "
                                                       "at most cores/2)")
    p.add_argument("--timeout-s", type=float, default=3600.0,
                   help="stop every file still running after this long (its partial output is kept)")
    a = p.parse_args(argv)
    a.pytest_args = extra
    if a.jobs < 0:
        p.error(f"--jobs must be >= 0, got {a.jobs}")
    if not a.timeout_s > 0:
        p.error(f"--timeout-s must be > 0, got {a.timeout_s}")
    return a


def run_one(path: str, mode: str, pytest_args: list[str], deadline: float) -> tuple[int, str, float]:
    """pytest on one file; killed at ``deadline`` (time.monotonic()) with rc 124, keeping
    the output it had written so far."""
    env = dict(os.environ, DFLASH_CUPY_DIFFERENTIAL=mode, DFLASH_CUPY_BACKEND="emulated")
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
                              *pytest_args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
        try:
            rc = p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            rc = 124
        out.seek(0)
        text = out.read()
    if rc == 124:
        text += "\n(killed at the runner's --timeout-s)"
    return rc, text, time.perf_counter() - t0


def main(argv=None) -> int:
    a = parse_args(argv)
    jobs = a.jobs or max(1, min(len(a.files), (os.cpu_count() or 2) // 2))
    deadline = time.monotonic() + a.timeout_s
    with ThreadPoolExecutor(jobs) as ex:
        results = list(ex.map(lambda f: run_one(f, a.mode, a.pytest_args, deadline), a.files))
    bad = []
    for f, (rc, out, secs) in zip(a.files, results):
        print(f"----- differential {f}: rc={rc} in {secs:.0f} s")
        print(out.rstrip())
        if rc != 0:
            bad.append(f)
    print(f"----- differential: {len(a.files) - len(bad)}/{len(a.files)} files passed"
          + (f"; failed: {' '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

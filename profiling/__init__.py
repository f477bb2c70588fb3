"""Benchmarks of the drafter step and its kernels (see profiling/README.md).

Run from the repository root, e.g. ``python -m profiling.bench_step --help``
(or ``python profiling/bench_step.py``). Every script has a ``--smoke`` mode
(tiny shapes, few repeats) that CI runs on the emulated backend.
"""

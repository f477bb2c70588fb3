"""The one timer every benchmark uses.

``measure(fn, backend, ...)`` runs ``fn`` ``warmup`` times, then takes
``repeats`` samples of ``inner`` back-to-back calls each and reports seconds
per call (median, min, p10, p90, mean over the samples):

* cuda backend: a pair of CUDA events around each sample, recorded on
  ``stream`` (the stream ``fn`` issues its work on), read after one final
  synchronisation. The host may run ahead of the device; an event pair then
  measures device time including any gaps the host leaves (a host-bound
  loop shows up as a slower step, as it should).
* emulated backend (and anything else): ``time.perf_counter`` around each
  sample (kernels run synchronously on the CPU there).

Graph-amortised timing: ``capture(backend, stream, fn, inner)`` records
``inner`` calls of ``fn`` into one graph, and ``measure(graph_launcher, ...)``
then times replays, so per-launch CPU overhead stays out of a kernel's time
(divide by ``inner``). ``flush`` (optional) runs untimed before each sample;
``l2_flush(backend, stream)`` builds one that evicts the L2 cache on a GPU.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Timing", "measure", "capture", "copy_bandwidth", "l2_flush", "l2_bytes", "raw_stream"]


@dataclass
class Timing:
    """Seconds per call, one entry per sample (a sample = ``inner`` calls)."""
    samples_s: list = field(default_factory=list)
    inner: int = 1
    method: str = "perf_counter"
    wall_s_per_call: float | None = None  # host wall clock over all samples (no flush)

    def _q(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.samples_s, dtype=np.float64), q))

    @property
    def median_s(self) -> float:
        return self._q(50)

    @property
    def min_s(self) -> float:
        return float(min(self.samples_s))

    def as_dict(self) -> dict:
        d = {"method": self.method, "samples": len(self.samples_s), "inner": self.inner,
             "median_us": self.median_s * 1e6, "min_us": self.min_s * 1e6,
             "p10_us": self._q(10) * 1e6, "p90_us": self._q(90) * 1e6,
             "mean_us": float(np.mean(self.samples_s)) * 1e6}
        if self.wall_s_per_call is not None:
            d["wall_us"] = self.wall_s_per_call * 1e6
        return d


def raw_stream(stream):
    """The CuPy stream behind a backend stream (``.raw``), or ``stream`` itself."""
    return getattr(stream, "raw", stream)


def _sync(backend, stream) -> None:
    if stream is not None and hasattr(stream, "synchronize"):
        stream.synchronize()
    backend.synchronize()


def measure(fn, backend, *, stream=None, warmup: int = 3, repeats: int = 10, inner: int = 1,
            min_repeats: int = 3, budget_s: float | None = None, flush=None) -> Timing:
    """Time ``fn()`` (see the module docstring). ``budget_s``: stop taking
    samples once this much wall time has passed (after ``min_repeats``)."""
    for name, v, lo in (("warmup", warmup, 0), ("repeats", repeats, 1), ("inner", inner, 1),
                        ("min_repeats", min_repeats, 1)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    _sync(backend, stream)  # an idle device: buffers memset on another stream (zeros) are done
    for _ in range(warmup):
        fn()
    _sync(backend, stream)
    if getattr(backend, "name", "") == "cuda":
        return _measure_cuda(fn, backend, stream, repeats, inner, min_repeats, budget_s, flush)
    return _measure_cpu(fn, backend, stream, repeats, inner, min_repeats, budget_s, flush)


def _measure_cpu(fn, backend, stream, repeats, inner, min_repeats, budget_s, flush) -> Timing:
    samples = []
    t_start = time.perf_counter()
    for i in range(repeats):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(backend, stream)
        samples.append((time.perf_counter() - t0) / inner)
        if budget_s is not None and i + 1 >= min_repeats and time.perf_counter() - t_start > budget_s:
            break
    wall = None if flush is not None else (time.perf_counter() - t_start) / (len(samples) * inner)
    return Timing(samples, inner, "perf_counter", wall)


def _measure_cuda(fn, backend, stream, repeats, inner, min_repeats, budget_s, flush) -> Timing:
    import cupy
    raw = raw_stream(stream)
    events = [(cupy.cuda.Event(), cupy.cuda.Event()) for _ in range(repeats)]
    used = 0
    t_start = time.perf_counter()
    for start, end in events:
        if flush is not None:
            flush()
        start.record(raw)
        for _ in range(inner):
            fn()
        end.record(raw)
        used += 1
        if budget_s is not None and used >= min_repeats and time.perf_counter() - t_start > budget_s:
            break
    events[used - 1][1].synchronize()
    wall = None if flush is not None else (time.perf_counter() - t_start) / (used * inner)
    samples = [cupy.cuda.get_elapsed_time(s, e) * 1e-3 / inner for s, e in events[:used]]
    return Timing(samples, inner, "cuda-events", wall)


def capture(backend, stream, fn, inner: int = 1):
    """A graph of ``inner`` calls of ``fn`` (which must issue its work on
    ``stream`` and be capture-safe). Returns the backend's ``Graph``."""
    backend.synchronize()  # what was allocated (and memset on another stream) is done before replays
    backend.begin_capture(stream)
    try:
        for _ in range(inner):
            fn()
    except BaseException:
        try:
            backend.end_capture(stream)
        except Exception:
            pass
        raise
    return backend.end_capture(stream)


def l2_bytes(backend) -> int:
    """The GPU's L2 size in bytes (0 on the emulated backend: no cache to flush)."""
    if getattr(backend, "name", "") != "cuda":
        return 0
    from dflash_cupy import device_props
    return device_props.query_cupy().l2_bytes


def l2_flush(backend, stream):
    """A callable that evicts the L2 cache (a device copy of 2x its size, on
    ``stream``), or None where there is nothing to flush (emulated backend)."""
    n = l2_bytes(backend)
    if n <= 0:
        return None
    n = 2 * n
    a = backend.empty((n,), np.uint8)
    b = backend.empty((n,), np.uint8)

    def flush():
        backend.copy_d2d_async(b, a, stream=stream)

    flush.buffers = (a, b)  # keep them alive with the callable
    return flush


def copy_bandwidth(backend, nbytes: int | None = None, *, repeats: int = 10) -> dict:
    """Device-to-device copy bandwidth, counting bytes read plus written
    (the measured ceiling a memory-bound kernel is compared against).
    Default size: 1 GiB per buffer on a GPU, 32 MiB on the emulator."""
    if nbytes is None:
        nbytes = (1 << 30) if getattr(backend, "name", "") == "cuda" else (32 << 20)
    nbytes = int(nbytes)
    stream = backend.stream()
    src = backend.empty((nbytes,), np.uint8)
    dst = backend.empty((nbytes,), np.uint8)
    t = measure(lambda: backend.copy_d2d_async(dst, src, stream=stream), backend, stream=stream,
                warmup=2, repeats=repeats)
    del src, dst
    moved = 2 * nbytes
    gbps = moved / t.median_s / 1e9 if t.median_s > 0 else math.inf
    return {"buffer_bytes": nbytes, "bytes_moved": moved, "GBps": gbps, "timing": t.as_dict()}

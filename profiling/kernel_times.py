"""Per-kernel device times of one drafter step, measured without nsys.

nsys does not run on the GPU machines this project is lent, and a graph replay
times only the whole step; the cost model's per-kernel predictions (issue 12:
within +-25% of measured) need each node's own time. ``step_kernel_times``
runs planned steps eagerly (``DraftKvCache.run(eager=True)``: the kernels,
arguments and order the graph holds) with an event recorded after every
kernel and copy (``backends.base.observe_launches``), all queued behind
``hold_stream`` (``cuda_src/hold.cu``). Launching from Python costs far more
host time per kernel than many of the kernels take on the device; the hold
keeps the stream busy until the host has queued the whole step, so the device
then runs it back to back and the time between two consecutive events is one
node: its kernel plus one event-record boundary (about a graph node's gap).
The sum over nodes beside the graph replay's step time says what the graph's
node gaps cost.

If the hold ends before the host has queued the step (the event after it has
completed when the last launch returns), the step is measured again with a
hold twice as long (three tries, then ``RuntimeError``): a host-bound number
is never reported as a kernel time.

Nodes are labelled as the cost model labels them (``step_trace.node_label``:
``gemm_stream[gate_up]``, ``memcpy h2d``), from the cache's own array names
(``step_trace.name_arrays``), so the measured table lines up with
``perf_model``'s groups (``perf_model.load_measured`` reads bench_step's
``"kernels"`` rows).

The emulated backend has no device clock: each node is run to completion
(``synchronize`` after it) and timed with the host clock. Those are the CPU's
times (``method`` says so); they check the plumbing (labels, order, sums) in
CI, never a GPU claim.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dflash_cupy import kernels
from dflash_cupy.backends.base import observe_launches

from .step_trace import ArrayRef, Copy, Launch, array_span, name_arrays, named, node_label

HOLD_TRIES = 3
HOLD_MIN_S = 200e-6


@dataclass
class StepKernelTimes:
    """Per node of one step, in issue order: ``labels[i]`` took ``us[i]`` (median over
    ``repeats`` steps)."""
    labels: list
    us: list
    method: str
    repeats: int
    hold_s: float = 0.0             # the hold that sufficed (cuda)
    samples_us: list = field(default_factory=list)   # [repeat][node]

    @property
    def total_us(self) -> float:
        return float(sum(self.us))

    def by_label(self) -> dict:
        """Summed per label, in order of first appearance (a role's node in every layer)."""
        out: dict = {}
        for label, us in zip(self.labels, self.us):
            out[label] = out.get(label, 0.0) + us
        return out

    def as_dict(self) -> dict:
        return {"method": self.method, "repeats": self.repeats, "hold_us": self.hold_s * 1e6,
                "sum_us": self.total_us, "kernels_us": self.by_label(),
                "nodes": [[label, us] for label, us in zip(self.labels, self.us)]}


def _ref(a, names) -> ArrayRef | None:
    span = array_span(a)
    if span is None:
        return None
    return named(ArrayRef("?", tuple(getattr(a, "shape", ())), str(getattr(a, "dtype", "?")), span[1], span[0]),
                 names)


def label_op(kind: str, name: str, args, names: dict) -> str:
    """The cost model's label of an observed launch (``kind`` "kernel", ``args`` by
    parameter name) or copy."""
    if kind == "copy":
        return node_label(Copy(name, 0, None, None))
    refs = [{k: _ref(v, names) or v for k, v in a.items()} if isinstance(a, dict) else _ref(a, names) or a
            for a in args.values()]
    return node_label(Launch(name, "", {}, (1, 1, 1), (1, 1, 1), 0, refs, names=list(args)))


class _Recorder:
    """The observer: per op its label and what marks its end (an event, or the host clock)."""

    def __init__(self, be, names, device_clock: bool):
        self.be, self.names, self.device_clock = be, names, device_clock
        self.labels, self.marks = [], []

    def __call__(self, kind, name, args, stream):
        self.labels.append(label_op(kind, name, args, self.names))
        if self.device_clock:
            ev = self.be.event()
            ev.record(stream)
            self.marks.append(ev)
        else:
            self.be.synchronize()
            self.marks.append(time.perf_counter())


def _elapsed_s(a, b) -> float:
    import cupy
    return cupy.cuda.get_elapsed_time(a.raw, b.raw) * 1e-3


def _hold_kernel(be):
    return kernels.load_module(be, "hold.cu").get_function("hold_stream")


CLOCK_HZ_FALLBACK = 2.5e9   # above any Hopper SM clock: a hold in cycles lasts at least as long


def _clock_hz(be) -> float:
    """The SM clock (``cudaDevAttrClockRate``, kHz); CUDA 13 dropped the property struct's
    field, and a failed query only lengthens the hold."""
    import cupy
    rt = cupy.cuda.runtime
    try:
        return float(rt.deviceGetAttribute(rt.cudaDevAttrClockRate, rt.getDevice())) * 1e3
    except Exception:
        return CLOCK_HZ_FALLBACK


def step_kernel_times(cache, ring, next_committed: Callable[[], int], *, repeats: int = 5,
                      stream=None) -> StepKernelTimes:
    """Time every node of ``repeats`` steps of ``cache`` (a ``DraftKvCache`` that has
    run its first step: its graphs and tuning are settled) on ``ring``: each step is
    ``begin_step(ring, next_committed())`` + ``run(eager=True)`` on ``stream`` (default:
    the current stream). Returns the per-node medians."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
    if not callable(next_committed):
        raise TypeError(f"next_committed must be callable (returns the step's committed count), "
                        f"got {type(next_committed).__name__}")
    be = cache.backend
    if be.is_capturing():
        raise RuntimeError("step_kernel_times: the backend is capturing (events would become graph nodes)")
    names = name_arrays(cache)
    s = be.current_stream() if stream is None else be.as_stream(stream)
    device_clock = be.name == "cuda"
    hold = _hold_kernel(be) if device_clock else None
    hold_s = 0.0
    if device_clock:
        # The host's time to queue one eager step, on a step that is not measured.
        cache.begin_step(ring, next_committed())
        t0 = time.perf_counter()
        cache.run(eager=True, stream=s)
        hold_s = max(HOLD_MIN_S, 2.0 * (time.perf_counter() - t0))
        be.synchronize()
        hz = _clock_hz(be)
        cycles = int(round(hold_s * hz))   # whole cycles, so a retry's hold is exactly twice as long
    samples, labels = [], None
    for _ in range(repeats):
        for _try in range(HOLD_TRIES):
            cache.begin_step(ring, next_committed())
            rec = _Recorder(be, names, device_clock)
            if device_clock:
                hold((1,), (1,), (np.int64(cycles),), stream=s)
                start = be.event()
                start.record(s)
            else:
                be.synchronize()
                start = time.perf_counter()
            with observe_launches(rec):
                cache.run(eager=True, stream=s)
            held = device_clock and not start.query()   # still holding: nothing ran early
            be.synchronize()
            if not device_clock or held:
                break
            hold_s *= 2
            cycles *= 2
        else:
            raise RuntimeError(f"step_kernel_times: the host still outran a {hold_s / 2 * 1e6:.0f} us hold "
                               f"after {HOLD_TRIES} tries; per-kernel times would be host-bound")
        if labels is None:
            labels = rec.labels
        elif rec.labels != labels:
            raise RuntimeError("step_kernel_times: two steps issued different node sequences "
                               f"({len(labels)} vs {len(rec.labels)} nodes)")
        marks = [start] + rec.marks
        if device_clock:
            samples.append([_elapsed_s(a, b) * 1e6 for a, b in zip(marks, marks[1:])])
        else:
            samples.append([(b - a) * 1e6 for a, b in zip(marks, marks[1:])])
    us = [statistics.median(col) for col in zip(*samples)]
    method = ("cuda events between nodes, eager step queued behind a hold" if device_clock
              else f"host clock per node ({be.name} backend: not a GPU time)")
    return StepKernelTimes(labels, us, method, repeats, hold_s, samples)

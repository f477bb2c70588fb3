"""``StepGraphs``: one step run eagerly or replayed as one of its two captured graphs (one
per descriptor buffer), captured on a private stream the first time."""
from __future__ import annotations

from .backends.base import programmatic_launches
from .nvtx_ranges import nvtx_range


class StepGraphs:
    """``StepGraphs(backend, issue, pdl=False, nvtx="dflash")``: a step run eagerly or as one
    of its graphs, one per descriptor buffer (``slots``), each captured on a private stream
    (``capture_stream``: a CUDA graph cannot be captured on the legacy default stream) the
    first time and replayed on the caller's stream after. ``issue(slot, stream, eager)``
    issues every launch and copy of one step. ``pdl``: each launch right after another launch
    of a capture carries programmatic stream serialization (``base.programmatic_launches``);
    eager steps never do."""

    def __init__(self, backend, issue, *, pdl: bool = False, nvtx: str = "dflash"):
        self.backend = backend
        self._issue = issue
        self.pdl = pdl
        self._nvtx = nvtx
        self.capture_stream = backend.stream()
        self.slots = [None, None]
        self.captures = 0      # step graphs captured so far

    def launch(self, slot: int, s, eager: bool) -> None:
        """Step ``slot`` on ``s``: its kernels one by one (``eager``), or its graph."""
        if eager:
            with nvtx_range(f"{self._nvtx} eager step", "yellow"):
                self._issue(slot, s, eager=True)
            return
        graph = self.slots[slot]
        if graph is None:
            be, cs = self.backend, self.capture_stream
            with nvtx_range(f"{self._nvtx} capture", "purple"):
                be.begin_capture(cs)
                try:
                    with programmatic_launches(self.pdl):
                        self._issue(slot, cs)
                finally:
                    graph = be.end_capture(cs)
                self.slots[slot] = graph
                self.captures += 1
        with nvtx_range(f"{self._nvtx} replay", "blue"):
            graph.launch(s)

    def release(self) -> None:
        """Drop the graphs and the capture stream (``captures`` stays readable)."""
        self.slots = [None, None]
        self._issue = self.capture_stream = None

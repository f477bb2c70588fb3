"""What ``DraftKvCache`` and ``DraftKvBatch`` share: issuing work on the
caller's stream after this object's earlier work (event edges on the device,
never a host wait), reusing pinned staging only once the work that read it
has run, and running a step either eagerly or as one of its step graphs,
captured on first use and replayed after."""
from __future__ import annotations

from .nvtx_ranges import nvtx_range


class StepIssuer:
    """Mixin. The subclass sets ``backend``, ``capture_stream``, ``_graphs``
    (one slot per descriptor buffer), ``captures``, ``host_waits``,
    ``_closed`` and calls ``_init_order()`` last in its constructor;
    ``_issue_step(slot, stream, eager)`` issues one step."""

    _nvtx = "dflash"   # NVTX range prefix

    def _init_order(self) -> None:
        # Construction memsets on the current stream: the first call on any other
        # stream waits for it on the device.
        be = self.backend
        self._tail = be.event()       # after the latest work this object issued
        self._tail.record(be.current_stream())
        self._tail_stream = be.current_stream()

    def _check_open(self):
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")

    def _order(self, stream):
        """The stream a call issues on: ``stream`` or the caller's current one,
        ordered (on the device) after the work this object issued elsewhere."""
        s = self.backend.as_stream(stream)
        if s != self._tail_stream:
            s.wait_event(self._tail)
        return s

    def _issued(self, s) -> None:
        """Work was issued on ``s``: the next call on another stream waits for it."""
        self._tail.record(s)
        self._tail_stream = s

    def _reuse(self, event) -> None:
        """Before rewriting a pinned buffer: wait for the work ``event`` follows
        only if it has not run yet (on a device that keeps up: never)."""
        if not event.query():
            event.synchronize()
            self.host_waits += 1

    def _launch_step(self, slot: int, s, eager: bool) -> None:
        """Step ``slot`` on ``s``: its kernels one by one (``eager``), or its graph
        (captured on the private capture stream the first time)."""
        be = self.backend
        if eager:
            with nvtx_range(f"{self._nvtx} eager step", "yellow"):
                self._issue_step(slot, s, eager=True)
            return
        if self._graphs[slot] is None:
            with nvtx_range(f"{self._nvtx} capture", "purple"):
                cs = self.capture_stream
                be.begin_capture(cs)
                try:
                    self._issue_step(slot, cs)
                finally:
                    graph = be.end_capture(cs)
                self._graphs[slot] = graph
                self.captures += 1
        with nvtx_range(f"{self._nvtx} replay", "blue"):
            self._graphs[slot].launch(s)

    def synchronize(self) -> None:
        """Host wait for every piece of work this object issued, on any stream."""
        self._tail.synchronize()

    def _close_wait(self) -> None:
        try:
            self._tail.synchronize()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

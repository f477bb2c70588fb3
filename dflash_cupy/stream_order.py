"""``StreamOrder``: how an object that issues device work on its callers' streams keeps that
work in order (``DraftKvCache``, ``DraftKvBatch``, ``FeatureRing``), on the device, never by a
host wait: a call on stream ``s`` waits (an event edge) for the latest work the object issued
on another stream; a pinned buffer is rewritten only once the work that read it has run."""
from __future__ import annotations


class StreamOrder:
    """``StreamOrder(backend)``: ``tail`` is recorded after the latest work the owner issued
    (first: construction's memsets on the current stream). ``order(stream, after=())``: the
    stream a call issues on (``stream`` or the current one), made to wait on the device for
    ``tail`` when it is another stream and for every event in ``after``; ``issued(s)``: work
    was issued on ``s``. ``reuse(event)``: before rewriting a pinned buffer, wait on the host
    for ``event`` only if it has not run (counted in ``host_waits``)."""

    def __init__(self, backend):
        self.backend = backend
        s = backend.current_stream()
        self.tail = backend.event()
        self.tail.record(s)
        self.tail_stream = s
        self.host_waits = 0

    def order(self, stream, after=()):
        s = self.backend.as_stream(stream)
        if s != self.tail_stream:
            s.wait_event(self.tail)
        for ev in after:
            s.wait_event(ev)
        return s

    def issued(self, s) -> None:
        self.tail.record(s)
        self.tail_stream = s

    def reuse(self, event) -> None:
        if not event.query():
            event.synchronize()
            self.host_waits += 1

    def synchronize(self) -> None:
        """Host wait for every piece of work the owner issued, on any stream."""
        self.tail.synchronize()

    def drain(self) -> None:
        """``synchronize`` for ``close``: an error of the queued work is not raised here."""
        try:
            self.tail.synchronize()
        except Exception:
            pass


class PinnedStaging:
    """``PinnedStaging(backend, shape, dtype, label)``: two pinned host buffers used in turn to
    copy host inputs to the device outside the step graph (noise embeddings, anchors).
    ``copy(order, dst, fill, s)``: wait (``order.reuse``) until the copy that last read the next
    buffer has run, ``fill(buffer)``, then copy it into ``dst`` on ``s``. ``events``: after the
    copy that read each buffer."""

    def __init__(self, backend, shape, dtype, label: str):
        self.backend, self.label = backend, label
        self.buffers = [backend.pinned_empty(shape, dtype) for _ in range(2)]
        for i, b in enumerate(self.buffers):
            b[...] = 0
            backend.label(b, f"{label} [{i}]")
        self.events = [backend.event() for _ in range(2)]
        self._next = 0

    def copy(self, order: StreamOrder, dst, fill, s) -> None:
        i = self._next
        self._next ^= 1
        order.reuse(self.events[i])   # the copy that last read this buffer
        stage = self.buffers[i]
        self.backend.host_write(stage, self.label)
        fill(stage)
        self.backend.copy_h2d_async(dst, stage, stream=s)
        self.events[i].record(s)

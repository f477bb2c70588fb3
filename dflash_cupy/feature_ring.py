"""``FeatureRing``: the target's captured hidden states, one feature row per
committed position, in a device ring (position ``p`` in slot ``p % capacity``).

The drafter step gathers the rows it appends straight from this ring on the
device (wraparound and dtype conversion included), so the ring is bound into
the step's CUDA graph by pointer: it is allocated once and never reallocated.

Which positions the ring holds is tracked as one contiguous range
``[lo, hi)`` (O(1) per write): ``write(start, rows)`` makes
``[start, start+n)`` the newest positions; positions after them are dropped
(a rewind rewrites from the rewind point), and only the last ``capacity``
positions survive.

Streams (CuPy's way): ``write`` issues its copies on the caller's current
stream (or ``stream=``), after every queued step that gathers from the ring
(event edges, on the device) and after the ring's previous write; a device
``rows`` array produced on that stream is read after it is written. The
host never waits, except to reuse a pinned staging chunk whose copy has not
run yet (``STAGE_CHUNKS`` chunks of ``STAGE_ROWS`` rows: a write of more rows
than that, or a device that has fallen that far behind).
"""
from __future__ import annotations

import weakref

import numpy as np

from . import backends, dtypes
from .checks import int_arg as _pos_int
from .interop import device_view
from .stream_order import StreamOrder

_STORAGE = dtypes.DEVICE
_HOST_VIEW = dtypes.HOST
STAGE_ROWS = 64   # rows per pinned staging chunk of a host write
STAGE_CHUNKS = 4  # staging chunks, reused round robin once their copy has run


F16_MAX = 65504.0


def _dead():
    return None


def _check_finite_rows(host: np.ndarray, kind: str) -> None:
    f = host.astype(np.float32, copy=False) if host.dtype.kind != "f" or host.dtype.itemsize < 4 else host
    bad = ~np.isfinite(f)
    if kind == "f16":
        bad |= np.abs(f) > F16_MAX
    if bad.any():
        r, c = (int(i) for i in np.argwhere(bad)[0])
        what = "overflows f16 (|x| > 65504)" if np.isfinite(f[r, c]) else "is not finite"
        raise ValueError(f"rows: {int(bad.sum())} value(s) refused; rows[{r}, {c}] = {f[r, c]!r} {what} "
                         f"(pass check_finite=False to store them anyway)")


class FeatureRing:
    """``FeatureRing(capacity, n_captured_layers, hidden_size, dtype=np.float32, backend=None)``.

    ``storage``: device array ``[capacity, n_captured_layers*hidden_size]`` of
    f32, f16 or bf16 (bf16 as uint16 bit patterns). ``storage=`` (keyword):
    use that device array instead of allocating one (``DraftKvBatch`` gives
    each lane's ring its slice of one lane-axis array).
    """

    def __init__(self, capacity: int, n_captured_layers: int, hidden_size: int, dtype=np.float32,
                 backend=None, *, storage=None):
        self.capacity = _pos_int(capacity, "capacity", 1)
        self.n_captured_layers = _pos_int(n_captured_layers, "n_captured_layers", 1)
        self.hidden_size = _pos_int(hidden_size, "hidden_size", 1)
        self.fc_in = self.n_captured_layers * self.hidden_size
        self.kind = dtypes.kind_of(dtype, "dtype")
        self.backend = backends.get(backend)
        be = self.backend
        if storage is None:
            storage = be.label(be.zeros((self.capacity, self.fc_in), _STORAGE[self.kind]), "FeatureRing.storage")
        elif (not be.is_device_array(storage) or tuple(storage.shape) != (self.capacity, self.fc_in)
              or storage.dtype != _STORAGE[self.kind] or not storage.flags.c_contiguous):
            raise ValueError(f"storage must be a C-contiguous device array of shape {(self.capacity, self.fc_in)} "
                             f"and dtype {np.dtype(_STORAGE[self.kind])}")
        self.storage = storage
        rows = min(STAGE_ROWS, self.capacity)
        self._stage = [be.label(be.pinned_empty((rows, self.fc_in), _STORAGE[self.kind]),
                                f"FeatureRing staging [{i}]") for i in range(STAGE_CHUNKS)]
        self._stage_events = [be.event() for _ in range(STAGE_CHUNKS)]
        self._stage_next = 0
        # The storage's latest writer (the memset of zeros, then each write): every reader and
        # the next write are ordered after it on the device (its tail event).
        self._stream_order = StreamOrder(be)
        self.lo = 0  # positions [lo, hi) are present
        self.hi = 0
        self._readers: dict = {}  # id(reader) -> event after its latest queued read of storage
        self._alive: dict = {}    # id(reader) -> weakref to it
        self.writes = 0           # write() calls so far: a reader that has waited for write N skips the next wait
        self._closed = False

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype as NumPy sees it (ml_dtypes.bfloat16 for bf16)."""
        return _HOST_VIEW[self.kind]

    def __repr__(self):
        return (f"FeatureRing(capacity={self.capacity}, fc_in={self.fc_in}, {self.kind}, "
                f"holds [{self.lo}, {self.hi}))")

    def _check_open(self):
        if self._closed:
            raise RuntimeError("FeatureRing is closed")

    def note_read(self, reader, event) -> None:
        """A reader (``DraftKvCache``) queued reads of ``storage`` on some
        stream, all done when ``event`` completes: later writes are ordered
        after them on the device (no write may replace a slot a queued step
        still has to gather)."""
        self._readers[id(reader)] = event
        ref = self._alive.get(id(reader))
        if ref is None or ref() is not reader:  # (an id can be reused by a new object)
            self._alive[id(reader)] = weakref.ref(reader)

    def forget_reader(self, reader) -> None:
        """``reader`` will issue no more reads (its queued ones are complete)."""
        self._readers.pop(id(reader), None)
        self._alive.pop(id(reader), None)

    @property
    def write_event(self):
        """Recorded after the latest write of ``storage``: readers on any stream wait on it."""
        return self._stream_order.tail

    @property
    def host_waits(self) -> int:
        """Times ``write`` had to wait for a staging chunk's copy."""
        return self._stream_order.host_waits

    def holds(self, start: int, stop: int) -> bool:
        """True when every position in ``[start, stop)`` is in the ring."""
        return stop <= start or (self.lo <= start and stop <= self.hi)

    def _segments(self, start: int, n: int):
        """(first row of the chunk, slot, count) pieces of ``[start, start+n)`` in ring order."""
        done = 0
        while done < n:
            slot = (start + done) % self.capacity
            c = min(n - done, self.capacity - slot)
            yield done, slot, c
            done += c

    def check_rows(self, rows, *, check_finite: bool = True):
        """``write``'s checks of ``rows`` (any number of them), before any change:
        ``(on_device, rows, host)``: a device view of them, or the NumPy rows and their
        copy in the storage's host dtype (bf16 as uint16 bits)."""
        self._check_open()
        dev = device_view(self.backend, rows, "rows", shape=(None, self.fc_in))  # foreign device arrays too
        if dev is not None:
            if dev.dtype != self.storage.dtype:
                raise TypeError(f"rows: a device array must have the ring's storage dtype "
                                f"{self.storage.dtype} ({self.kind}), got {dev.dtype}")
            return True, dev, None
        rows = np.asarray(rows)
        if rows.ndim != 2 or rows.shape[1] != self.fc_in:
            raise ValueError(f"rows must have shape [n, {self.fc_in}], got {list(rows.shape)}")
        host = rows
        if host.dtype.kind not in "fiu" and host.dtype != _HOST_VIEW["bf16"]:
            raise TypeError(f"rows: expected a float array, got dtype {host.dtype}")
        if check_finite:
            _check_finite_rows(host, self.kind)
        with np.errstate(over="ignore"):  # (refused above unless check_finite=False)
            host = host.astype(_HOST_VIEW[self.kind], copy=False)
        if self.kind == "bf16":
            host = host.view(np.uint16)
        return False, rows, host

    def write(self, start_pos: int, rows, stream=None, *, check_finite: bool = True) -> None:
        """Store feature rows ``[n, fc_in]`` (NumPy of any float dtype, or a
        device array of the storage dtype) for positions ``start_pos ..``,
        on the current stream (or ``stream``), without a host wait.

        Non-finite data: host rows with NaN/Inf, or values an f16 ring cannot
        hold (|x| > 65504 would become inf), are refused with ``ValueError``
        (``check_finite=False`` stores them as they convert). Device rows are
        not inspected (that would need a host wait); the cache isolates what
        they leave behind: a slot outside a step's window never reaches its
        output, whatever it holds."""
        self._check_open()
        start = _pos_int(start_pos, "start_pos")
        be = self.backend
        stream = be.as_stream(stream)
        on_device, rows, host = self.check_rows(rows, check_finite=check_finite)
        n = int(rows.shape[0])
        if n > self.capacity:
            raise ValueError(f"rows: {n} rows do not fit a ring of capacity {self.capacity}")
        if start + n > 2**31 - 1:
            raise ValueError(f"start_pos={start}: positions overflow int32")
        # ---- validated: from here on the ring changes
        # readers garbage-collected without close(): dropped once their last read has run
        self._readers = {k: ev for k, ev in self._readers.items()
                         if self._alive.get(k, _dead)() is not None or not ev.query()}
        # on the caller's stream, after the ring's previous write and every queued reader
        s = self._stream_order.order(stream, after=self._readers.values())
        if on_device:
            for r0, slot, c in self._segments(start, n):
                be.copy_d2d_async(self.storage[slot:slot + c], rows[r0:r0 + c], stream=s)
        else:
            cap = self._stage[0].shape[0]
            for r0, slot, c in self._segments(start, n):
                for k in range(0, c, cap):
                    m = min(cap, c - k)
                    i = self._stage_next
                    self._stage_next = (i + 1) % len(self._stage)
                    ev = self._stage_events[i]
                    self._stream_order.reuse(ev)  # this chunk's previous copy must have run
                    stage = self._stage[i]
                    be.host_write(stage[:m], "FeatureRing.write (staging)")
                    stage[:m] = host[r0 + k:r0 + k + m]
                    be.copy_h2d_async(self.storage[slot + k:slot + k + m], stage[:m], stream=s)
                    ev.record(s)
        self._stream_order.issued(s)
        self.writes += 1
        new_hi = start + n
        new_lo = self.lo if self.lo <= start <= self.hi else start
        self.lo, self.hi = max(new_lo, new_hi - self.capacity), new_hi

    def read(self, start_pos: int, n: int, stream=None) -> np.ndarray:
        """Feature rows ``[n, fc_in]`` of positions ``start_pos ..`` as NumPy
        (the storage dtype; bf16 as ml_dtypes.bfloat16), read on the current
        stream (or ``stream``) after the latest write; the host waits for it."""
        self._check_open()
        start, n = _pos_int(start_pos, "start_pos"), _pos_int(n, "n")
        if not self.holds(start, start + n):
            raise KeyError(f"positions [{start}, {start + n}) are not all in the ring "
                           f"(it holds [{self.lo}, {self.hi}))")
        s = self.backend.as_stream(stream)
        s.wait_event(self.write_event)
        host = self.backend.to_numpy(self.storage, stream=s)
        out = np.concatenate([host[slot:slot + c] for _, slot, c in self._segments(start, n)]
                             or [host[:0]], axis=0)
        return out.view(_HOST_VIEW[self.kind])

    def reset(self) -> None:
        self._check_open()
        self.lo = self.hi = 0

    def close(self) -> None:
        self.storage = None
        self._stage = None
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

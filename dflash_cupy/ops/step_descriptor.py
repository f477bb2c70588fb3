"""The step descriptor (``cuda_src/step_desc.cuh``) and the host side of
planning one drafter step (SPEC §3 steps 1-4).

Per step the host does O(1) work: ``plan_step`` decides rewind / bulk append
/ in-graph append from ``(next_pos, committed)``, ``fill_descriptor`` writes
the int32 step descriptor into a pinned buffer, one captured H2D copy moves
it to the device, and the planning kernels (``ops.gather``, ``ops.ring_slots``)
derive everything else there.

The bulk append (more than ``a_step`` missing rows) uses the same kernels
outside the graph, one chunk per launch (``bulk_chunks``), with a descriptor
whose ``start``/``n_new`` describe the chunk and ``n_rows`` = the chunk
length (no trash padding, no noise positions).

The descriptor's field indices and length are read from
``cuda_src/step_desc.cuh``, their one definition (the fields are described
there).

A captured copy reads its pinned source when the replay runs: do not rewrite
a descriptor buffer before the replay that reads it has executed (one event
per replay, or alternating buffers).
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from .. import kernels
from ..geometry import RingGeometry

_C = kernels.constants("step_desc.cuh")
DESC_COMMITTED, DESC_LO, DESC_START = _C["DESC_COMMITTED"], _C["DESC_LO"], _C["DESC_START"]
DESC_N_NEW, DESC_SWA_LO, DESC_RESET = _C["DESC_N_NEW"], _C["DESC_SWA_LO"], _C["DESC_RESET"]
DESC_ACTIVE = _C["DESC_ACTIVE"]
DESC_CTX_ROW0, DESC_CTX_ROWS = _C["DESC_CTX_ROW0"], _C["DESC_CTX_ROWS"]
DESC_LEN = _C["DESC_LEN"]
# the order fill_descriptor packs the fields in
_FIELDS = ("committed", "lo", "start", "n_new", "swa_lo", "reset", "active")
assert [DESC_COMMITTED, DESC_LO, DESC_START, DESC_N_NEW, DESC_SWA_LO, DESC_RESET, DESC_ACTIVE] == list(range(7)), \
    "step_desc.cuh: fill_descriptor packs the fields in index order 0..6"
assert DESC_LEN > DESC_CTX_ROWS == DESC_CTX_ROW0 + 1 == DESC_ACTIVE + 2
_DESC_STRUCT = struct.Struct(f"={DESC_LEN}i")
INT32_MAX = 2**31 - 1


class StepFields(NamedTuple):
    """What ``begin_step(committed)`` decides (SPEC §3 steps 1-4).

    ``reset``: rewind, the ring must be emptied first (``next_pos`` was beyond
    ``committed``): by ``reset_slots`` before the bulk chunks when
    ``bulk_count > 0``, else inside the graph via the descriptor's reset flag.
    ``bulk_start, bulk_count``: rows to bulk-append outside the graph (count
    0: none). ``start, n_new``: rows the step appends itself.
    """
    committed: int
    lo: int
    start: int
    n_new: int
    swa_lo: int
    reset: bool
    bulk_start: int
    bulk_count: int
    # (a NamedTuple: plan_step runs on the per-step host path, where a frozen
    # dataclass costs microseconds)


def plan_step(next_pos: int, committed: int, geom: RingGeometry, swa_window=0) -> StepFields:
    """SPEC §3 steps 1-4 and the masks' window bounds for one step."""
    if not isinstance(geom, RingGeometry):
        raise TypeError(f"geom must be a RingGeometry, got {type(geom).__name__}")
    committed, next_pos = int(committed), int(next_pos)
    if committed <= 0:
        raise ValueError(f"committed={committed}: must be > 0")
    if committed + geom.q_len > INT32_MAX:
        raise ValueError(f"committed={committed}: noise positions overflow int32")
    if next_pos < 0:
        raise ValueError(f"next_pos={next_pos}: must be >= 0")
    w = int(swa_window or 0)
    if w < 0:
        raise ValueError(f"swa_window={swa_window}: must be >= 0 (0: no limit)")
    reset = next_pos > committed
    if reset:
        next_pos = 0
    win = min(committed, geom.capacity)
    lo = committed - win
    start = max(next_pos, lo)
    n_new = committed - start
    bulk_start, bulk_count = start, 0
    if n_new > geom.a_step:
        bulk_count = n_new
        start, n_new = committed, 0
    eff = w if 0 < w < win else win
    return StepFields(committed=committed, lo=lo, start=start, n_new=n_new,
                      swa_lo=committed - eff, reset=reset,
                      bulk_start=bulk_start, bulk_count=bulk_count)


def bulk_chunks(bulk_start: int, bulk_count: int, chunk: int):
    """``(start, count)`` of each bulk-append chunk of at most ``chunk`` rows."""
    out = []
    s, n = int(bulk_start), int(bulk_count)
    while n > 0:
        c = min(n, chunk)
        out.append((s, c))
        s += c
        n -= c
    return out


def fill_descriptor(buf: np.ndarray, committed: int, lo: int, start: int, n_new: int,
                    swa_lo: int, reset: bool = False, active: bool = True) -> np.ndarray:
    """Write the step descriptor fields into ``buf`` (a host int32 array of at
    least ``DESC_LEN`` elements, normally pinned) and return it. ``active``
    False marks an idle lane of a ``DraftKvBatch`` (single caches: always True)."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.int32 or buf.ndim != 1 or not buf.flags.c_contiguous \
            or buf.shape[0] < DESC_LEN:
        raise TypeError(f"buf must be a 1-D C-contiguous host int32 array of >= {DESC_LEN} elements")
    vals = (int(committed), int(lo), int(start), int(n_new), int(swa_lo))
    if not (0 <= min(vals) and max(vals) <= INT32_MAX):
        for name, v in zip(("committed", "lo", "start", "n_new", "swa_lo"), vals):
            if not 0 <= v <= INT32_MAX:
                raise ValueError(f"descriptor field {name}={v} must be in [0, 2^31)")
    # struct packs straight into the (pinned) buffer: far cheaper than NumPy item writes
    _DESC_STRUCT.pack_into(buf, 0, *vals, 1 if reset else 0, 1 if active else 0, *(0,) * (DESC_LEN - 7))
    return buf


def fill_step_descriptor(buf: np.ndarray, fields: StepFields) -> np.ndarray:
    """``fill_descriptor`` from a ``plan_step`` result (the in-graph step).

    The reset flag is set only for a rewind without a bulk append: when a bulk
    append ran, its caller already emptied the ring (``reset_slots``) before
    the first chunk, and an in-graph reset would wipe what the chunks wrote."""
    return fill_descriptor(buf, fields.committed, fields.lo, fields.start, fields.n_new,
                           fields.swa_lo, fields.reset and fields.bulk_count == 0)


def fill_chunk_descriptor(buf: np.ndarray, fields: StepFields, start: int, count: int) -> np.ndarray:
    """Descriptor of one bulk-append chunk ``[start, start+count)`` (reset clear:
    the bulk path resets the ring with ``reset_slots`` before its first chunk)."""
    return fill_descriptor(buf, fields.committed, fields.lo, start, count, fields.swa_lo, False)


def pack_context_rows(desc: np.ndarray, a_step: int) -> int:
    """``DraftKvBatch``: the lanes' appended context rows packed back to back in
    lane order: writes ``DESC_CTX_ROW0`` (exclusive prefix sum of each active
    lane's ``min(n_new, a_step)``) and ``DESC_CTX_ROWS`` (their total, in every
    lane's row) of ``desc [lanes, DESC_LEN]`` (host int32) and returns the total.
    ``gather.cu``'s ``plan_lanes`` reads them."""
    n_app = np.minimum(desc[:, DESC_N_NEW], a_step) * (desc[:, DESC_ACTIVE] != 0)
    total = int(n_app.sum())
    desc[:, DESC_CTX_ROW0] = np.cumsum(n_app) - n_app
    desc[:, DESC_CTX_ROWS] = total
    return total

"""The step descriptor (``cuda_src/step_desc.cuh``) and the host side of
planning one drafter step (SPEC §3 steps 1-4).

Per step the host does O(1) work per lane: ``decide_lanes`` (the one host
planner; ``plan_step`` is its one-lane form) decides rewind / bulk append /
in-graph append from ``(next_pos, committed)`` and lists the int32 step
descriptors, ``pack_descriptors`` (the one packer) writes them into a pinned
buffer, one captured H2D copy moves it to the device, and the planning
kernels (``ops.gather``, ``ops.ring_slots``) derive everything else there.

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
assert DESC_CTX_ROWS == DESC_CTX_ROW0 + 1 == DESC_ACTIVE + 2 and DESC_LEN == 10, \
    "step_desc.cuh: decide_lanes lists a lane's descriptor as one 10-int tuple, the context rows at 7 and 8"
INT32_MAX = 2**31 - 1
_STRUCTS: dict = {}                         # int32 count -> struct.Struct (pack_descriptors)


class StepFields(NamedTuple):
    """What ``begin_step(committed)`` decides (SPEC §3 steps 1-4).

    ``reset``: rewind, the ring must be emptied first (``next_pos`` was beyond
    ``committed`` and the ring no longer holds the rewound window): by
    ``reset_slots`` before the bulk chunks when ``bulk_count > 0``, else inside
    the graph via the descriptor's reset flag. A rewind whose window the ring still
    holds (``rewind_slack``) has ``reset`` clear and appends nothing.
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


class LaneDecisions(NamedTuple):
    """``decide_lanes``' decisions for one step of every lane.

    ``vals``: the descriptors, ``DESC_LEN`` ints per lane in lane order
    (``pack_descriptors``), the active lanes' appended context rows packed back to back
    (``DESC_CTX_ROW0``, ``DESC_CTX_ROWS``; ``pack_context_rows``); a lane that needs a bulk
    append first has ``start = committed, n_new = 0`` and its reset flag clear (the bulk path
    resets). The step (the graph) reads ring positions ``[start, committed)`` of each active
    lane. ``bulk``: ``(lane, StepFields)`` of the lanes that need a bulk append first.
    ``restart``: ``(lane, position)`` of the lanes whose cached rows stop being one run
    ending at ``next_pos`` (a reset or a jump past ``next_pos``): after this step the lane
    holds ``[position, committed)`` (its ``kv_lo``, see ``decide_lanes``)."""
    vals: list
    bulk: list
    restart: list

    def fields(self, lane: int):
        """Lane ``lane``'s ``StepFields`` (``None``: idle)."""
        c, lo, start, n_new, swa_lo, reset, active = self.vals[lane * DESC_LEN:lane * DESC_LEN + 7]
        if not active:
            return None
        for i, f in self.bulk:
            if i == lane:
                return f
        return StepFields(c, lo, start, n_new, swa_lo, bool(reset), start, 0)


def _missing(start: int, stop: int, ring) -> str:
    """The positions of ``[start, stop)`` that ``ring`` does not hold, as ranges."""
    lo, hi = ring.lo, ring.hi
    if hi <= lo or stop <= lo or hi <= start:
        return f"[{start}, {stop})"
    parts = [f"[{a}, {b})" for a, b in ((start, min(stop, lo)), (max(start, hi), stop)) if a < b]
    return " and ".join(parts)


def _not_held(lane: str, start: int, v: int, n: int, rewound: bool, r, geom: RingGeometry) -> KeyError:
    why = (f" (a rewind from next_pos={n} that the K/V ring's rewind_slack={geom.rewind_slack} does not "
           f"cover appends the whole window again)" if rewound else "")
    return KeyError(f"{lane}feature rows for positions [{start}, {v}) are not all in {'the' if not lane else 'its'} "
                    f"ring (it holds [{r.lo}, {r.hi}); missing {_missing(start, v, r)}); committed={v}{why}: "
                    f"write them into the ring first, or re-prefill (reset, then prefill, which streams a "
                    f"prompt longer than the ring)")


def decide_lanes(committed, next_pos, rings, geom: RingGeometry, swa_window=0, *, single: bool = False,
                 kv_lo=None, in_graph_max=None) -> LaneDecisions:
    """The host planner (SPEC §3 steps 1-4 and the masks' window bounds) of one step of
    every lane: ``committed[i]`` (an int > 0, or ``None``: lane ``i`` idle), ``next_pos[i]``
    (its next position to append), ``rings[i]`` (its ``FeatureRing``: it must hold the rows the
    step appends). Validates every lane before returning (nothing changes state here): a bad
    entry raises naming its lane (``single``: a ``DraftKvCache``'s one lane, named as its
    arguments; ``None`` not allowed).

    Rewinds (``next_pos > committed``): with ``geom.rewind_slack > 0`` a lane whose K/V ring
    still holds every position of the rewound window ``[lo, committed)`` (from ``kv_lo[i]``,
    the first position of the run of rows it appended up to ``next_pos``, and the ring's
    ``slots``) only moves ``next_pos`` back: rows at positions >= committed stay in their
    slots, hidden by the masks (``slot_pos >= committed``) until re-appended over. Any other
    rewind (and every rewind at slack 0) resets the lane and appends its window again from
    the feature ring. ``kv_lo`` (default: every lane's run starts at 0) is read only then.
    ``in_graph_max`` (default ``a_step``): lanes appending more rows are bulk-appended first
    (0: every appending lane; ``append`` without a step).
    Plain Python, one pass: for a few lanes far cheaper than NumPy's fixed cost, ~0.4 us per
    lane."""
    cap, A = geom.capacity, geom.a_step if in_graph_max is None else in_graph_max
    slack, slots = geom.rewind_slack, geom.slots
    vmax = INT32_MAX - geom.q_len             # the last noise position must fit int32
    w = int(swa_window or 0)
    vals, bulk, restart = [], [], []
    row0 = 0                                  # packed context rows so far
    # (the lane's index, for messages: len(vals) // DESC_LEN, the lanes listed so far)
    for v, n, r in zip(committed, next_pos, rings):
        if v is None and not single:
            vals += (0, 0, 0, 0, 0, 0, 0, row0, 0, 0)
            continue
        if type(v) is not int:
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise TypeError(f"committed must be an int, got {type(v).__name__}" if single else
                                f"committed[{len(vals) // DESC_LEN}] must be an int or None (idle), "
                                f"got {type(v).__name__}")
            v = int(v)
        if r._closed:
            raise RuntimeError("ring is closed" if single else f"lane {len(vals) // DESC_LEN}: its ring is closed")
        if not 0 < v <= vmax:
            e = f"committed={v}: must be > 0" if v <= 0 else f"committed={v}: noise positions overflow int32"
            raise ValueError(e if single else f"committed[{len(vals) // DESC_LEN}]: {e}")
        win = v if v < cap else cap
        lo = v - win
        n0 = n
        reset = n > v
        if reset:
            # the K/V ring holds [max(kv_lo, n - slots), n): enough for the rewound window?
            if slack and max(0 if kv_lo is None else kv_lo[len(vals) // DESC_LEN], n - slots) <= lo:
                reset, n = False, v
            else:
                n = 0
        start = n if n > lo else lo
        nn = v - start
        if nn and not (r.lo <= start and v <= r.hi):
            raise _not_held("" if single else f"lane {len(vals) // DESC_LEN}: ", start, v, n0, reset, r, geom)
        if reset or start > n:   # the lane's cached run restarts at start
            restart.append((len(vals) // DESC_LEN, start))
        if nn > A:    # a bulk append first, outside the graph (it resets the ring itself)
            swa_lo = v - w if 0 < w < win else lo
            bulk.append((len(vals) // DESC_LEN, StepFields(v, lo, v, 0, swa_lo, reset, start, nn)))
            vals += (v, lo, v, 0, swa_lo, 0, 1, row0, 0, 0)
        else:
            vals += (v, lo, start, nn, v - w if 0 < w < win else lo, reset, 1, row0, 0, 0)
            row0 += nn
    vals[DESC_CTX_ROWS::DESC_LEN] = [row0] * (len(vals) // DESC_LEN)
    return LaneDecisions(vals, bulk, restart)


class _EveryPosition:
    """A ring stand-in that holds every position (``plan_step`` plans without one)."""
    lo, hi, capacity, _closed = 0, 1 << 62, 1 << 62, False


def plan_step(next_pos: int, committed: int, geom: RingGeometry, swa_window=0) -> StepFields:
    """``decide_lanes`` for one lane, with no ring to check."""
    if not isinstance(geom, RingGeometry):
        raise TypeError(f"geom must be a RingGeometry, got {type(geom).__name__}")
    next_pos = int(next_pos)
    if next_pos < 0:
        raise ValueError(f"next_pos={next_pos}: must be >= 0")
    if int(swa_window or 0) < 0:
        raise ValueError(f"swa_window={swa_window}: must be >= 0 (0: no limit)")
    return decide_lanes((committed,), (next_pos,), (_EveryPosition,), geom, swa_window, single=True).fields(0)


def pack_descriptors(buf: np.ndarray, vals) -> np.ndarray:
    """The one descriptor packer: ``vals`` (``DESC_LEN`` ints per lane, as ``decide_lanes``
    lists them) into ``buf`` (host int32, normally pinned), with ``struct``: far cheaper
    than NumPy item writes."""
    st = _STRUCTS.get(len(vals))
    if st is None:
        st = _STRUCTS[len(vals)] = struct.Struct(f"={len(vals)}i")
    st.pack_into(buf, 0, *vals)
    return buf


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
    return pack_descriptors(buf, (*vals, 1 if reset else 0, 1 if active else 0, *(0,) * (DESC_LEN - 7)))


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
    """The lanes' appended context rows packed back to back in lane order, for
    descriptors written one by one (``fill_descriptor``; ``decide_lanes`` lists them so
    itself): writes ``DESC_CTX_ROW0`` (exclusive prefix sum of each active lane's
    ``min(n_new, a_step)``) and ``DESC_CTX_ROWS`` (their total, in every lane's row) of
    ``desc [lanes, DESC_LEN]`` (host int32) and returns the total. ``step_plan.cu``'s
    ``plan_lanes`` reads them."""
    n_app = np.minimum(desc[:, DESC_N_NEW], a_step) * (desc[:, DESC_ACTIVE] != 0)
    total = int(n_app.sum())
    desc[:, DESC_CTX_ROW0] = np.cumsum(n_app) - n_app
    desc[:, DESC_CTX_ROWS] = total
    return total

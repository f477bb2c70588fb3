"""Device-side step planning (``cuda_src/plan.cu``), the step descriptor and
NumPy references of SPEC §3 steps 1-5.

Per step the host does O(1) work: ``plan_step`` decides rewind / bulk append
/ in-graph append from ``(next_pos, committed)``, ``fill_descriptor`` writes
the int32 step descriptor into a pinned buffer, one captured H2D copy moves
it to the device, and the kernels derive everything else on the device:

* ``StepPlanner.reset_slots_if``: empties ``slot_pos`` when the descriptor's
  reset flag is set (a rewind handled inside the replayed graph);
* ``StepPlanner.plan_append``: append positions/rows (padding -> trash slot),
  ``slot_pos`` updates, noise positions;
* ``FeatureGather``: the new feature rows from the feature ring, as f32;
* ``StepPlanner.build_masks``: the full / sliding-window masks from ``slot_pos``.

The bulk append (more than ``a_step`` missing rows) uses the same kernels
outside the graph, one chunk of at most ``BULK_CHUNK`` rows per launch, with
a descriptor whose ``start``/``n_new`` describe the chunk and ``n_rows`` = the
chunk length (no trash padding, no noise positions).

Step descriptor (int32 ``[DESC_LEN]``, same indices as plan.cu):

====  ================  ====================================================
 0    ``committed``     tokens committed; noise positions ``committed + j``
 1    ``lo``            ``committed - min(committed, capacity)``
 2    ``start``         first position appended (step or bulk chunk)
 3    ``n_new``         rows appended (0 after a bulk append)
 4    ``swa_lo``        ``committed - eff`` (sliding-window start)
 5    ``reset``         1: ``reset_slots_if`` empties the ring (rewind)
 6-7  reserved          0
====  ================  ====================================================

A captured copy reads its pinned source when the replay runs: do not rewrite
a descriptor buffer before the replay that reads it has executed (one event
per replay, or alternating buffers).
"""
from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np

from .. import dtypes, kernels
from ..geometry import BULK_CHUNK, RingGeometry
from .gemm import _check_array, _overlaps

DESC_COMMITTED, DESC_LO, DESC_START, DESC_N_NEW, DESC_SWA_LO, DESC_RESET = range(6)
DESC_LEN = 8
_DESC_STRUCT = struct.Struct(f"={DESC_LEN}i")
RING_DTYPES = dtypes.CODE
GATHER_THREADS = 256
INT32_MAX = 2**31 - 1


def ring_kind(dtype) -> str:
    """``"f32" | "f16" | "bf16"`` of a ring dtype (``np.uint16`` = bf16 bits)."""
    return dtypes.kind_of(dtype, "ring_dtype")


# --------------------------------------------------------------------------- host side, O(1)
class StepFields(NamedTuple):
    """What ``begin_step(committed)`` decides (SPEC §3 steps 1-4).

    ``reset``: rewind, the ring must be emptied first (``next_pos`` was beyond
    ``committed``): by ``reset_slots`` before the bulk chunks when
    ``bulk_count > 0``, else inside the graph via the descriptor's reset flag. ``bulk_start, bulk_count``: rows to bulk-append outside the
    graph (count 0: none). ``start, n_new``: rows the step appends itself.
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

    @property
    def next_pos(self) -> int:
        return self.committed


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


def bulk_chunks(bulk_start: int, bulk_count: int, chunk: int = BULK_CHUNK):
    """``(start, count)`` of each bulk-append chunk."""
    out = []
    s, n = int(bulk_start), int(bulk_count)
    while n > 0:
        c = min(n, chunk)
        out.append((s, c))
        s += c
        n -= c
    return out


def fill_descriptor(buf: np.ndarray, committed: int, lo: int, start: int, n_new: int,
                    swa_lo: int, reset: bool = False) -> np.ndarray:
    """Write the step descriptor fields into ``buf`` (a host int32 array of at
    least ``DESC_LEN`` elements, normally pinned) and return it."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.int32 or buf.ndim != 1 or not buf.flags.c_contiguous \
            or buf.shape[0] < DESC_LEN:
        raise TypeError(f"buf must be a 1-D C-contiguous host int32 array of >= {DESC_LEN} elements")
    vals = (int(committed), int(lo), int(start), int(n_new), int(swa_lo))
    if not (0 <= min(vals) and max(vals) <= INT32_MAX):
        for name, v in zip(("committed", "lo", "start", "n_new", "swa_lo"), vals):
            if not 0 <= v <= INT32_MAX:
                raise ValueError(f"descriptor field {name}={v} must be in [0, 2^31)")
    # struct packs straight into the (pinned) buffer: far cheaper than NumPy item writes
    _DESC_STRUCT.pack_into(buf, 0, *vals, 1 if reset else 0, *(0,) * (DESC_LEN - 6))
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


# --------------------------------------------------------------------------- device side
def _check_desc(be, desc):
    _check_array(be, "desc", desc, np.int32, ndim=1)
    if desc.shape[0] < DESC_LEN:
        raise ValueError(f"desc must hold >= {DESC_LEN} int32, got shape {tuple(desc.shape)}")


def _rows_arg(n_rows, default, name="n_rows") -> int:
    if n_rows is None:
        return int(default)
    if not isinstance(n_rows, (int, np.integer)) or isinstance(n_rows, bool):
        raise TypeError(f"{name} must be an int, got {type(n_rows).__name__}")
    if n_rows < 0:
        raise ValueError(f"{name}={n_rows} must be >= 0")
    return int(n_rows)


class StepPlanner:
    """Planning kernels of one ring geometry: ``StepPlanner(backend, geom)``.

    All methods take device arrays and ``stream``; no allocation, no host sync
    (capture-safe). ``slot_pos [capacity] int32``, ``desc [DESC_LEN] int32``.
    """

    def __init__(self, backend, geom: RingGeometry):
        if not isinstance(geom, RingGeometry):
            raise TypeError(f"geom must be a RingGeometry, got {type(geom).__name__}")
        self.backend = backend
        self.geom = geom
        self._module = kernels.load_module(backend, "plan.cu", CAP=geom.capacity, Q_LEN=geom.q_len,
                                           KV_TOTAL=geom.kv_total)
        f = self._module.get_function
        self._reset, self._reset_if = f("reset_slots"), f("reset_slots_if")
        self._append = f("plan_append")
        self._masks, self._mask_full, self._mask_swa = \
            f("build_masks"), f("build_mask_full"), f("build_mask_swa")
        self._slot_grid = (-(-geom.capacity // 256), 1, 1)
        self._mask_grid = (-(-geom.kv_total // 128), 1, 1)

    def __repr__(self):
        return f"StepPlanner({self.geom})"

    def _check_slot_pos(self, slot_pos):
        _check_array(self.backend, "slot_pos", slot_pos, np.int32, ndim=1)
        if slot_pos.shape[0] != self.geom.capacity:
            raise ValueError(f"slot_pos must have shape ({self.geom.capacity},), "
                             f"got {tuple(slot_pos.shape)}")

    def reset_slots(self, slot_pos, stream=None):
        """``slot_pos[:] = -1``."""
        self._check_slot_pos(slot_pos)
        self._reset(self._slot_grid, (256, 1, 1), (slot_pos,), stream=stream)

    def reset_slots_if(self, desc, slot_pos, stream=None):
        """``slot_pos[:] = -1`` when ``desc[DESC_RESET]`` is set (decided at replay)."""
        _check_desc(self.backend, desc)
        self._check_slot_pos(slot_pos)
        self._reset_if(self._slot_grid, (256, 1, 1), (desc, slot_pos), stream=stream)

    def plan_append(self, desc, ap_pos, ap_rows, slot_pos, pos_q=None, n_rows=None, stream=None):
        """Append rows ``i < n_rows`` (default ``len(ap_pos)``): real rows
        ``i < desc.n_new`` get ``pos = start+i``, ``row = pos % capacity`` and
        update ``slot_pos``; the rest get ``pos 0, row trash_slot``. With
        ``pos_q [q_len] int32``: ``pos_q[j] = committed + j``."""
        be = self.backend
        _check_desc(be, desc)
        _check_array(be, "ap_pos", ap_pos, np.int32, ndim=1)
        _check_array(be, "ap_rows", ap_rows, np.int32, ndim=1)
        self._check_slot_pos(slot_pos)
        n = _rows_arg(n_rows, ap_pos.shape[0])
        if ap_pos.shape[0] < n or ap_rows.shape[0] < n:
            raise ValueError(f"ap_pos ({ap_pos.shape[0]}) and ap_rows ({ap_rows.shape[0]}) "
                             f"must hold n_rows={n} entries")
        arrays = [("desc", desc), ("ap_pos", ap_pos), ("ap_rows", ap_rows), ("slot_pos", slot_pos)]
        n_q = 0
        if pos_q is not None:
            _check_array(be, "pos_q", pos_q, np.int32, ndim=1)
            if pos_q.shape[0] != self.geom.q_len:
                raise ValueError(f"pos_q must have shape ({self.geom.q_len},), got {tuple(pos_q.shape)}")
            n_q = self.geom.q_len
            arrays.append(("pos_q", pos_q))
        for i, (na, a) in enumerate(arrays):
            for nb, b in arrays[i + 1:]:
                if _overlaps(a, b):
                    raise ValueError(f"{na} and {nb} must not overlap")
        work = max(n, n_q)
        if work == 0:
            return
        self._append((-(-work // 128), 1, 1), (128, 1, 1),
                     (desc, ap_pos, ap_rows, slot_pos, pos_q if pos_q is not None else ap_pos,
                      np.int32(n), np.int32(n_q)), stream=stream)

    def build_masks(self, desc, slot_pos, mask_full=None, mask_swa=None, stream=None):
        """SPEC §3 step 5 into ``mask_full`` and/or ``mask_swa``
        (``[q_len, kv_total]`` f16). Run after ``plan_append`` in stream order."""
        be = self.backend
        _check_desc(be, desc)
        self._check_slot_pos(slot_pos)
        shape = (self.geom.q_len, self.geom.kv_total)
        given = [(n, m) for n, m in (("mask_full", mask_full), ("mask_swa", mask_swa)) if m is not None]
        if not given:
            raise ValueError("build_masks needs mask_full and/or mask_swa")
        for name, m in given:
            _check_array(be, name, m, np.float16, ndim=2)
            if tuple(m.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(m.shape)}")
        if mask_full is not None and mask_swa is not None and _overlaps(mask_full, mask_swa):
            raise ValueError("mask_full and mask_swa must not overlap")
        block = (128, 1, 1)
        if mask_full is not None and mask_swa is not None:
            self._masks(self._mask_grid, block, (desc, slot_pos, mask_full, mask_swa), stream=stream)
        elif mask_full is not None:
            self._mask_full(self._mask_grid, block, (desc, slot_pos, mask_full), stream=stream)
        else:
            self._mask_swa(self._mask_grid, block, (desc, slot_pos, mask_swa), stream=stream)


class FeatureGather:
    """``FeatureGather(backend, fc_in, ring_capacity, ring_dtype)``:
    ``__call__(desc, ring, ap_feat, n_rows=None, stream=None)`` writes
    ``ap_feat[i] = f32(ring[(start+i) % ring_capacity])`` for ``i < n_new`` and
    zeros for ``n_new <= i < n_rows`` (default ``len(ap_feat)``).
    ``ring [ring_capacity, fc_in]`` f32 / f16 / bf16 (uint16 bits);
    ``ap_feat [>= n_rows, fc_in]`` f32. Capture-safe."""

    def __init__(self, backend, fc_in: int, ring_capacity: int, ring_dtype):
        for name, v in (("fc_in", fc_in), ("ring_capacity", ring_capacity)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.backend = backend
        self.fc_in, self.ring_capacity = int(fc_in), int(ring_capacity)
        self.kind = ring_kind(ring_dtype)
        self.ring_device_dtype = dtypes.DEVICE[self.kind]
        self._module = kernels.load_module(backend, "plan.cu", FC_IN=self.fc_in,
                                           RING_CAP=self.ring_capacity,
                                           RING_DTYPE=RING_DTYPES[self.kind],
                                           GATHER_THREADS=GATHER_THREADS)
        self._kernel = self._module.get_function("gather_features")
        self._gx = -(-self.fc_in // (GATHER_THREADS * 4))

    def __repr__(self):
        return f"FeatureGather(fc_in={self.fc_in}, ring_capacity={self.ring_capacity}, ring={self.kind})"

    def __call__(self, desc, ring, ap_feat, n_rows=None, stream=None):
        be = self.backend
        _check_desc(be, desc)
        _check_array(be, "ring", ring, self.ring_device_dtype, ndim=2)
        if tuple(ring.shape) != (self.ring_capacity, self.fc_in):
            raise ValueError(f"ring must have shape {(self.ring_capacity, self.fc_in)}, "
                             f"got {tuple(ring.shape)}")
        _check_array(be, "ap_feat", ap_feat, np.float32, ndim=2)
        if ap_feat.shape[1] != self.fc_in:
            raise ValueError(f"ap_feat must have {self.fc_in} columns, got shape {tuple(ap_feat.shape)}")
        n = _rows_arg(n_rows, ap_feat.shape[0])
        if ap_feat.shape[0] < n:
            raise ValueError(f"ap_feat has {ap_feat.shape[0]} rows, fewer than n_rows={n}")
        if _overlaps(ap_feat, ring) or _overlaps(ap_feat, desc):
            raise ValueError("ap_feat must not overlap ring or desc")
        if n == 0:
            return
        self._kernel((self._gx, n, 1), (GATHER_THREADS, 1, 1),
                     (desc, ring, ap_feat, np.int32(n)), stream=stream)


# --------------------------------------------------------------------------- references
def plan_append_reference(desc, slot_pos, n_rows: int, geom: RingGeometry, with_noise: bool = True):
    """NumPy oracle of ``plan_append``: returns ``(ap_pos, ap_rows, slot_pos,
    pos_q or None)`` (int32; ``slot_pos`` a new array)."""
    desc = np.asarray(desc, dtype=np.int64)
    start, n_new, committed = int(desc[DESC_START]), int(desc[DESC_N_NEW]), int(desc[DESC_COMMITTED])
    sp = np.array(slot_pos, dtype=np.int32, copy=True)
    ap_pos = np.zeros(n_rows, dtype=np.int32)
    ap_rows = np.full(n_rows, geom.trash_slot, dtype=np.int32)
    for i in range(min(n_new, n_rows)):
        p = start + i
        ap_pos[i] = p
        ap_rows[i] = p % geom.capacity
        sp[p % geom.capacity] = p
    pos_q = (committed + np.arange(geom.q_len)).astype(np.int32) if with_noise else None
    return ap_pos, ap_rows, sp, pos_q


def gather_features_reference(desc, ring, n_rows: int) -> np.ndarray:
    """NumPy oracle of ``gather_features``: f32 ``[n_rows, fc_in]``; ``ring`` f32,
    f16 or bf16 (uint16 bit patterns or ml_dtypes.bfloat16)."""
    ring = np.asarray(ring)
    if ring.dtype == np.uint16:
        ring32 = (ring.astype(np.uint32) << 16).view(np.float32)
    else:
        ring32 = ring.astype(np.float32)
    start, n_new = int(desc[DESC_START]), int(desc[DESC_N_NEW])
    out = np.zeros((n_rows, ring.shape[1]), dtype=np.float32)
    k = min(n_new, n_rows)
    if k:
        out[:k] = ring32[(start + np.arange(k)) % ring.shape[0]]
    return out

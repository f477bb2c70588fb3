"""Device-side step planning (``cuda_src/plan.cu``) and its NumPy reference
(SPEC §3 steps 2-5): from the step descriptor (``ops.step_descriptor``)

* ``StepPlanner.reset_slots_if``: empties ``slot_pos`` when the descriptor's
  reset flag is set (a rewind handled inside the replayed graph);
* ``StepPlanner.plan_append``: append positions/rows (padding -> trash slot),
  ``slot_pos`` updates, noise positions;
* ``StepPlanner.build_masks``: the full / sliding-window masks from ``slot_pos``.
"""
from __future__ import annotations

import numpy as np

from .. import checks, kernels
from ..geometry import RingGeometry
from .step_descriptor import DESC_COMMITTED, DESC_LEN, DESC_N_NEW, DESC_START

_C = kernels.constants("step_desc.cuh")
SLOT_THREADS, ROW_THREADS = _C["PLAN_SLOT_THREADS"], _C["PLAN_ROW_THREADS"]


def check_desc(be, desc):
    """``desc`` is a device int32 step descriptor."""
    checks.device_array(be, "desc", desc, np.int32, ndim=1)
    if desc.shape[0] < DESC_LEN:
        raise ValueError(f"desc must hold >= {DESC_LEN} int32, got shape {tuple(desc.shape)}")


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
        self._slot_grid = (-(-geom.capacity // SLOT_THREADS), 1, 1)
        self._mask_grid = (-(-geom.kv_total // ROW_THREADS), 1, 1)

    def __repr__(self):
        return f"StepPlanner({self.geom})"

    def _check_slot_pos(self, slot_pos):
        checks.device_array(self.backend, "slot_pos", slot_pos, np.int32, ndim=1)
        if slot_pos.shape[0] != self.geom.capacity:
            raise ValueError(f"slot_pos must have shape ({self.geom.capacity},), "
                             f"got {tuple(slot_pos.shape)}")

    def reset_slots(self, slot_pos, stream=None):
        """``slot_pos[:] = -1``."""
        self._check_slot_pos(slot_pos)
        self._reset(self._slot_grid, (SLOT_THREADS, 1, 1), (slot_pos,), stream=stream)

    def reset_slots_if(self, desc, slot_pos, stream=None):
        """``slot_pos[:] = -1`` when ``desc[DESC_RESET]`` is set (decided at replay)."""
        check_desc(self.backend, desc)
        self._check_slot_pos(slot_pos)
        self._reset_if(self._slot_grid, (SLOT_THREADS, 1, 1), (desc, slot_pos), stream=stream)

    def plan_append(self, desc, ap_pos, ap_rows, slot_pos, pos_q=None, n_rows=None, stream=None):
        """Append rows ``i < n_rows`` (default ``len(ap_pos)``): real rows
        ``i < desc.n_new`` get ``pos = start+i``, ``row = pos % capacity`` and
        update ``slot_pos``; the rest get ``pos 0, row trash_slot``. With
        ``pos_q [q_len] int32``: ``pos_q[j] = committed + j``."""
        be = self.backend
        check_desc(be, desc)
        checks.device_array(be, "ap_pos", ap_pos, np.int32, ndim=1)
        checks.device_array(be, "ap_rows", ap_rows, np.int32, ndim=1)
        self._check_slot_pos(slot_pos)
        n = ap_pos.shape[0] if n_rows is None else checks.int_arg(n_rows, "n_rows")
        if ap_pos.shape[0] < n or ap_rows.shape[0] < n:
            raise ValueError(f"ap_pos ({ap_pos.shape[0]}) and ap_rows ({ap_rows.shape[0]}) "
                             f"must hold n_rows={n} entries")
        arrays = dict(desc=desc, ap_pos=ap_pos, ap_rows=ap_rows, slot_pos=slot_pos)
        n_q = 0
        if pos_q is not None:
            checks.device_array(be, "pos_q", pos_q, np.int32, ndim=1)
            if pos_q.shape[0] != self.geom.q_len:
                raise ValueError(f"pos_q must have shape ({self.geom.q_len},), got {tuple(pos_q.shape)}")
            n_q = self.geom.q_len
            arrays["pos_q"] = pos_q
        checks.check_no_overlap(**arrays)
        work = max(n, n_q)
        if work == 0:
            return
        self._append((-(-work // ROW_THREADS), 1, 1), (ROW_THREADS, 1, 1),
                     (desc, ap_pos, ap_rows, slot_pos, pos_q if pos_q is not None else ap_pos,
                      np.int32(n), np.int32(n_q)), stream=stream)

    def build_masks(self, desc, slot_pos, mask_full=None, mask_swa=None, stream=None):
        """SPEC §3 step 5 into ``mask_full`` and/or ``mask_swa``
        (``[q_len, kv_total]`` f16). Run after ``plan_append`` in stream order."""
        be = self.backend
        check_desc(be, desc)
        self._check_slot_pos(slot_pos)
        shape = (self.geom.q_len, self.geom.kv_total)
        given = [(n, m) for n, m in (("mask_full", mask_full), ("mask_swa", mask_swa)) if m is not None]
        if not given:
            raise ValueError("build_masks needs mask_full and/or mask_swa")
        for name, m in given:
            checks.device_array(be, name, m, np.float16, ndim=2)
            if tuple(m.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(m.shape)}")
        if mask_full is not None and mask_swa is not None and checks.overlaps(mask_full, mask_swa):
            raise ValueError("mask_full and mask_swa must not overlap")
        block = (ROW_THREADS, 1, 1)
        if mask_full is not None and mask_swa is not None:
            self._masks(self._mask_grid, block, (desc, slot_pos, mask_full, mask_swa), stream=stream)
        elif mask_full is not None:
            self._mask_full(self._mask_grid, block, (desc, slot_pos, mask_full), stream=stream)
        else:
            self._mask_swa(self._mask_grid, block, (desc, slot_pos, mask_swa), stream=stream)


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

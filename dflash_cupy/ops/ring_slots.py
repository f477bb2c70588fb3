"""The ring's slot table and append rows outside the step graph
(``cuda_src/ring_slots.cu``, SPEC §3 steps 2-4) and their NumPy reference:
the bulk path, which appends a rewind's or a jump's rows in chunks before the
step graph runs (the graph's own planning is ``ops.gather``'s ``plan_step``).

* ``RingSlots.reset_slots``: ``slot_pos[:] = -1``;
* ``RingSlots.plan_append``: append positions/rows (padding -> trash slot),
  ``slot_pos`` updates, noise positions; ``plan_append_reference`` its oracle.
  The rows go through the lane's page table (``kv_pages.py``): physical rows of a pool.
"""
from __future__ import annotations

import numpy as np

from .. import checks, kernels
from ..geometry import RingGeometry
from ..kv_pages import PAGE_ALIGN, check_page, dense_table, physical_rows
from .step_descriptor import DESC_COMMITTED, DESC_LEN, DESC_N_NEW, DESC_START

_C = kernels.constants("step_desc.cuh")
SLOT_THREADS, ROW_THREADS = _C["PLAN_SLOT_THREADS"], _C["PLAN_ROW_THREADS"]


def check_desc(be, desc):
    """``desc`` is a device int32 step descriptor."""
    checks.device_array(be, "desc", desc, np.int32, ndim=1)
    if desc.shape[0] < DESC_LEN:
        raise ValueError(f"desc must hold >= {DESC_LEN} int32, got shape {tuple(desc.shape)}")


class RingSlots:
    """Slot-table kernels of one ring geometry: ``RingSlots(backend, geom, page=32)``
    (``page``: rows per K/V page of the tables ``plan_append`` reads).

    All methods take device arrays and ``stream``; no allocation, no host sync
    (capture-safe). ``slot_pos [slots] int32`` (``geom.slots``: the window plus the rewind
    slack), ``desc [DESC_LEN] int32``.
    """

    def __init__(self, backend, geom: RingGeometry, page: int = PAGE_ALIGN):
        if not isinstance(geom, RingGeometry):
            raise TypeError(f"geom must be a RingGeometry, got {type(geom).__name__}")
        self.backend = backend
        self.geom = geom
        self.page = check_page(page)
        # the lane's own rows [0, kv_total) as a table: plan_append without pages
        self._dense = backend.asarray(dense_table(1, geom.kv_total, self.page)[0])
        self._module = kernels.load_module(backend, "ring_slots.cu", CAP=geom.slots, Q_LEN=geom.q_len,
                                           KV_TOTAL=geom.kv_total, PAGE=self.page)
        f = self._module.get_function
        self._reset, self._append = f("reset_slots"), f("plan_append")
        self._slot_grid = (-(-geom.slots // SLOT_THREADS), 1, 1)

    def __repr__(self):
        return f"RingSlots({self.geom})"

    def _check_slot_pos(self, slot_pos):
        checks.device_array(self.backend, "slot_pos", slot_pos, np.int32, ndim=1)
        if slot_pos.shape[0] != self.geom.slots:
            raise ValueError(f"slot_pos must have shape ({self.geom.slots},), "
                             f"got {tuple(slot_pos.shape)}")

    def reset_slots(self, slot_pos, stream=None):
        """``slot_pos[:] = -1``."""
        self._check_slot_pos(slot_pos)
        self._reset(self._slot_grid, (SLOT_THREADS, 1, 1), (slot_pos,), stream=stream)

    def plan_append(self, desc, ap_pos, ap_rows, slot_pos, pos_q=None, n_rows=None, stream=None, pages=None):
        """Append rows ``i < n_rows`` (default ``len(ap_pos)``): real rows
        ``i < desc.n_new`` get ``pos = start+i``, slot ``pos % slots`` (its
        ``slot_pos`` updated) and ``row`` = that slot's row; the rest get ``pos 0,
        row`` = the trash slot's. Rows through ``pages`` (the lane's page table, device
        int32 ``[ceil(kv_total / page)]``: physical rows), else the lane's own rows. With
        ``pos_q [q_len] int32``: ``pos_q[j] = committed + j``."""
        be = self.backend
        check_desc(be, desc)
        if pages is None:
            pages = self._dense
        checks.device_array(be, "pages", pages, np.int32, ndim=1)
        if pages.shape[0] != self._dense.shape[0]:
            raise ValueError(f"pages must have shape ({self._dense.shape[0]},) (kv_total={self.geom.kv_total} "
                             f"rows in pages of {self.page}), got {tuple(pages.shape)}")
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
                     (desc, pages, ap_pos, ap_rows, slot_pos, pos_q if pos_q is not None else ap_pos,
                      np.int32(n), np.int32(n_q)), stream=stream)


def plan_append_reference(desc, slot_pos, n_rows: int, geom: RingGeometry, with_noise: bool = True,
                          pages=None, page: int = PAGE_ALIGN):
    """NumPy oracle of ``plan_append``: returns ``(ap_pos, ap_rows, slot_pos,
    pos_q or None)`` (int32; ``slot_pos`` a new array); rows through ``pages`` (the
    lane's page table of ``page``-row pages) when given."""
    desc = np.asarray(desc, dtype=np.int64)
    start, n_new, committed = int(desc[DESC_START]), int(desc[DESC_N_NEW]), int(desc[DESC_COMMITTED])
    sp = np.array(slot_pos, dtype=np.int32, copy=True)
    ap_pos = np.zeros(n_rows, dtype=np.int32)
    ap_rows = np.full(n_rows, geom.trash_slot, dtype=np.int32)
    for i in range(min(n_new, n_rows)):
        p = start + i
        ap_pos[i] = p
        ap_rows[i] = p % geom.slots
        sp[p % geom.slots] = p
    pos_q = (committed + np.arange(geom.q_len)).astype(np.int32) if with_noise else None
    if pages is not None:
        ap_rows = physical_rows(pages, page, geom.kv_total)[ap_rows].astype(np.int32)
    return ap_pos, ap_rows, sp, pos_q

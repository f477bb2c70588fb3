"""The feature gather (``cuda_src/step_plan.cu``) and its NumPy reference: the
new feature rows of a step or bulk chunk, read from the feature ring at the
positions the step descriptor names, widened to f32.

``FeatureGather.plan_lanes`` is the step graph's whole planning in one launch, for
every lane of the step engine: ``reset_slots_if`` + ``RingSlots.plan_append`` + this
gather + ``build_masks`` (tests/support/planning_unfused.py; their NumPy references are
the oracle)."""
from __future__ import annotations

import numpy as np

from .. import checks, dtypes, kernels
from ..geometry import RingGeometry
from ..kv_pages import PAGE_ALIGN, check_page, dense_table, pages_per_lane
from ..mask_rule import MaskRule
from .ring_slots import check_desc
from .step_descriptor import DESC_LEN, DESC_N_NEW, DESC_START

THREADS = 256  # columns per block pass (4 per thread)


class FeatureGather:
    """``FeatureGather(backend, fc_in, ring_capacity, ring_dtype)``:
    ``__call__(desc, ring, ap_feat, n_rows=None, stream=None)`` writes
    ``ap_feat[i] = f32(ring[(start+i) % ring_capacity])`` for ``i < n_new`` and
    zeros for ``n_new <= i < n_rows`` (default ``len(ap_feat)``).
    ``ring [ring_capacity, fc_in]`` f32 / f16 / bf16 (uint16 bits);
    ``ap_feat [>= n_rows, fc_in]`` f32. Capture-safe."""

    def __init__(self, backend, fc_in: int, ring_capacity: int, ring_dtype):
        self.backend = backend
        self.fc_in = checks.int_arg(fc_in, "fc_in", 1)
        self.ring_capacity = checks.int_arg(ring_capacity, "ring_capacity", 1)
        self.kind = dtypes.kind_of(ring_dtype, "ring_dtype")
        self.ring_device_dtype = dtypes.DEVICE[self.kind]
        self._module = kernels.load_module(backend, "step_plan.cu", FC_IN=self.fc_in,
                                           RING_CAP=self.ring_capacity,
                                           RING_DTYPE=dtypes.CODE[self.kind],
                                           GATHER_THREADS=THREADS)
        self._kernel = self._module.get_function("gather_features")
        self._lanes_kernel = self._module.get_function("plan_lanes")
        self._gx = -(-self.fc_in // (THREADS * 4))
        self._dense = {}   # (lanes, kv_total, page) -> the dense layout's page table, on the device

    def __repr__(self):
        return f"FeatureGather(fc_in={self.fc_in}, ring_capacity={self.ring_capacity}, ring={self.kind})"

    def __call__(self, desc, ring, ap_feat, n_rows=None, stream=None):
        be = self.backend
        check_desc(be, desc)
        checks.device_array(be, "ring", ring, self.ring_device_dtype, ndim=2)
        if tuple(ring.shape) != (self.ring_capacity, self.fc_in):
            raise ValueError(f"ring must have shape {(self.ring_capacity, self.fc_in)}, "
                             f"got {tuple(ring.shape)}")
        checks.device_array(be, "ap_feat", ap_feat, np.float32, ndim=2)
        if ap_feat.shape[1] != self.fc_in:
            raise ValueError(f"ap_feat must have {self.fc_in} columns, got shape {tuple(ap_feat.shape)}")
        n = ap_feat.shape[0] if n_rows is None else checks.int_arg(n_rows, "n_rows")
        if ap_feat.shape[0] < n:
            raise ValueError(f"ap_feat has {ap_feat.shape[0]} rows, fewer than n_rows={n}")
        if checks.overlaps(ap_feat, ring) or checks.overlaps(ap_feat, desc):
            raise ValueError("ap_feat must not overlap ring or desc")
        if n == 0:
            return
        self._kernel((self._gx, n, 1), (THREADS, 1, 1),
                     (desc, ring, ap_feat, np.int32(n)), stream=stream)

    def dense_pages(self, lanes: int, kv_total: int, page: int = PAGE_ALIGN):
        """The dense layout's page tables (lane ``i``'s rows at ``i*kv_total``), on the device,
        built once (``plan_lanes`` without ``pages``; call it before a capture that does)."""
        key = (lanes, kv_total, page)
        if key not in self._dense:
            if self.backend.is_capturing():
                raise RuntimeError("plan_lanes without pages= during a capture: call dense_pages(lanes, "
                                   "kv_total, page) once before it (an allocation cannot be captured)")
            self._dense[key] = self.backend.asarray(dense_table(lanes, kv_total, page))
        return self._dense[key]

    def plan_lanes(self, desc, ring, ap_feat, geom, slot_pos, pos_all, rows_all, tile_live, *, cs: int, bs: int,
                   mask_full=None, mask_swa=None, rule=None, stream=None, pages=None, page: int = PAGE_ALIGN):
        """The step's planning for every lane in one launch (``step_plan.cu``'s
        ``plan_lanes``: layouts there): per active lane, in effect and in this order,
        ``slot_pos[lane] = -1`` if its reset flag is set, the append plan of its new rows
        (packed at ``DESC_CTX_ROW0``) and its noise positions, the gather of those rows into
        ``ap_feat``, and the masks from the updated slot table. ``desc [lanes, DESC_LEN]``,
        ``ring [lanes, ring_capacity, fc_in]``, ``ap_feat [lanes*cs, fc_in]``,
        ``slot_pos [lanes, slots]`` (``geom.slots``: the window plus the rewind slack),
        ``pos_all``/``rows_all [lanes*(cs+bs)]``,
        ``tile_live [lanes*(cs+bs)/16]`` int32, masks ``[lanes, q_len, kv_total]`` under
        ``rule`` (a ``MaskRule``, or a bare sliding window: ``MaskRule.of``). ``rows_all``:
        physical rows through ``pages`` (the lanes' page tables of ``page``-row pages, device
        int32 ``[lanes, ceil(kv_total / page)]``, ``kv_pages.py``), else the dense layout
        (lane ``i``'s rows at ``i*kv_total``)."""
        be = self.backend
        if not isinstance(geom, RingGeometry):
            raise TypeError(f"geom must be a RingGeometry, got {type(geom).__name__}")
        rule = MaskRule.of(rule)
        checks.device_array(be, "desc", desc, np.int32, ndim=2)
        lanes = desc.shape[0]
        if lanes < 1 or desc.shape[1] != DESC_LEN:
            raise ValueError(f"desc must have shape [lanes, {DESC_LEN}], got {tuple(desc.shape)}")
        cs, bs = checks.int_arg(cs, "cs", 16), checks.int_arg(bs, "bs", 16)
        if cs % 16 or bs % 16 or cs < geom.a_step or bs < geom.q_len:
            raise ValueError(f"cs={cs} and bs={bs} must be multiples of 16 holding a_step={geom.a_step} and "
                             f"q_len={geom.q_len} rows")
        if lanes * geom.kv_total >= 2**31:
            raise ValueError(f"lanes={lanes} x kv_total={geom.kv_total} cache rows overflow int32")
        rows = lanes * (cs + bs)
        page = check_page(page)
        n_pages = pages_per_lane(geom.kv_total, page)
        if pages is None:
            pages = self.dense_pages(lanes, geom.kv_total, page)
        for name, a, dt, shape in (("pages", pages, np.int32, (lanes, n_pages)),("ring", ring, self.ring_device_dtype, (lanes, self.ring_capacity, self.fc_in)),
                                   ("ap_feat", ap_feat, np.float32, (lanes * cs, self.fc_in)),
                                   ("slot_pos", slot_pos, np.int32, (lanes, geom.slots)),
                                   ("pos_all", pos_all, np.int32, (rows,)),
                                   ("rows_all", rows_all, np.int32, (rows,)),
                                   ("tile_live", tile_live, np.int32, (rows // 16,))):
            checks.device_array(be, name, a, dt, ndim=len(shape))
            if tuple(a.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
        given = [(nm, m) for nm, m in (("mask_full", mask_full), ("mask_swa", mask_swa)) if m is not None]
        if not given:
            raise ValueError("plan_lanes needs mask_full and/or mask_swa")
        for nm, m in given:
            checks.device_array(be, nm, m, np.float16, ndim=3)
            if tuple(m.shape) != (lanes, geom.q_len, geom.kv_total):
                raise ValueError(f"{nm} must have shape {(lanes, geom.q_len, geom.kv_total)}, got {tuple(m.shape)}")
        checks.check_no_overlap(desc=desc, ring=ring, ap_feat=ap_feat, slot_pos=slot_pos, pos_all=pos_all,
                                rows_all=rows_all, tile_live=tile_live, **dict(given))
        flags = (1 if mask_full is not None else 0) | (2 if mask_swa is not None else 0) | rule.flags
        mf = mask_full if mask_full is not None else mask_swa
        ms = mask_swa if mask_swa is not None else mask_full
        a = geom.a_step
        blocks = self._gx * a + -(-max(geom.kv_total, cs, bs) // THREADS)
        self._lanes_kernel((blocks, lanes, 1), (THREADS, 1, 1),
                           (desc, ring, ap_feat, np.int32(a), np.int32(cs), slot_pos, pos_all, rows_all, tile_live,
                            mf, ms, np.int32(geom.slots), np.int32(geom.q_len), np.int32(bs),
                            np.int32(geom.kv_total), np.int32(flags), np.int32(rule.window),
                            np.int32(lanes), pages, np.int32(page), np.int32(n_pages)), stream=stream)


def gather_features_reference(desc, ring, n_rows: int) -> np.ndarray:
    """NumPy oracle of ``gather_features``: f32 ``[n_rows, fc_in]``; ``ring`` f32,
    f16 or bf16 (uint16 bit patterns or ml_dtypes.bfloat16)."""
    ring = np.asarray(ring)
    ring32 = dtypes.to_float(ring, np.float32)
    start, n_new = int(desc[DESC_START]), int(desc[DESC_N_NEW])
    out = np.zeros((n_rows, ring.shape[1]), dtype=np.float32)
    k = min(n_new, n_rows)
    if k:
        out[:k] = ring32[(start + np.arange(k)) % ring.shape[0]]
    return out


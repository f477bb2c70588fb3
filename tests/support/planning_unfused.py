"""The step graph's planning as separate launches (``tests/cuda/planning_unfused.cu``):
the reference that ``ops.gather``'s fused ``plan_step`` is tested against. The
product never launches these kernels; ``UnfusedPlanning`` adds them to the
product's ``RingSlots`` (``reset_slots``, ``plan_append``), so one object drives
``reset_slots_if`` + ``plan_append`` + ``gather_features`` + ``build_masks``.

* ``reset_slots_if``: empties ``slot_pos`` when the descriptor's reset flag is set;
* ``build_masks``: the full / sliding-window masks from ``slot_pos``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cupy import checks, kernels
from dflash_cupy.mask_rule import MaskRule
from dflash_cupy.ops.ring_slots import ROW_THREADS, SLOT_THREADS, RingSlots, check_desc

SOURCE = Path(__file__).resolve().parent.parent / "cuda" / "planning_unfused.cu"
_modules: dict = {}   # (id(backend), options) -> module, as kernels.load_module caches


def _module(backend, geom):
    opts = kernels.compile_options(CAP=geom.slots, Q_LEN=geom.q_len, KV_TOTAL=geom.kv_total)
    key = (id(backend), opts)
    if key not in _modules:
        _modules[key] = backend.compile(SOURCE.read_text(), opts, filename=str(SOURCE))
    return _modules[key]


class UnfusedPlanning(RingSlots):
    """``UnfusedPlanning(backend, geom)``: ``RingSlots`` plus the test-only kernels."""

    def __init__(self, backend, geom):
        super().__init__(backend, geom)
        f = _module(backend, geom).get_function
        self._reset_if = f("reset_slots_if")
        self._masks, self._mask_full, self._mask_swa = \
            f("build_masks"), f("build_mask_full"), f("build_mask_swa")
        self._mask_grid = (-(-geom.kv_total // ROW_THREADS), 1, 1)

    def __repr__(self):
        return f"UnfusedPlanning({self.geom})"

    def reset_slots_if(self, desc, slot_pos, stream=None):
        """``slot_pos[:] = -1`` when ``desc[DESC_RESET]`` is set (decided at replay)."""
        check_desc(self.backend, desc)
        self._check_slot_pos(slot_pos)
        self._reset_if(self._slot_grid, (SLOT_THREADS, 1, 1), (desc, slot_pos), stream=stream)

    def build_masks(self, desc, slot_pos, mask_full=None, mask_swa=None, stream=None, *, rule=None):
        """SPEC §3 step 5 into ``mask_full`` and/or ``mask_swa``
        (``[q_len, kv_total]`` f16) under ``rule`` (a ``MaskRule`` or a bare sliding
        window, ``MaskRule.of``). Run after ``plan_append`` in stream order."""
        be = self.backend
        rule = MaskRule.of(rule)
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
        r = (np.int32(rule.flags), np.int32(rule.window))
        if mask_full is not None and mask_swa is not None:
            self._masks(self._mask_grid, block, (desc, slot_pos, mask_full, mask_swa) + r, stream=stream)
        elif mask_full is not None:
            self._mask_full(self._mask_grid, block, (desc, slot_pos, mask_full) + r, stream=stream)
        else:
            self._mask_swa(self._mask_grid, block, (desc, slot_pos, mask_swa) + r, stream=stream)

"""Which keys a block row sees: the attention-mask rule (SPEC §3.5 and §6), decided once
per drafter and read by the oracle (``reference.py``), the host planner and the planning
kernel (``cuda_src/plan_mask.cuh``).

Two window rules for sliding layers (``W = sliding_window``; 0 or None: no limit):

* ``"per_row"`` (the default): the serving engines' and z-lab's current rule
  (``dflash/model.py`` ``_attention_mask``; vLLM and SGLang DFlash): keys at absolute
  positions, block row ``i`` (position ``committed + i``) sees key ``k`` when
  ``(committed + i) - k < W``, and also ``k - (committed + i) < W`` when the layer is not
  causal. Row ``i`` sees context positions ``committed + i - W + 1 .. committed - 1``.
* ``"anchored"``: the seed's rule (SPEC §3.5): every block row sees the last
  ``min(W, window)`` context positions before ``committed``.

Causality inside the block: a causal layer shows block key ``j`` to row ``i`` iff
``j <= i``. ``is_causal`` from the config decides it for every layer when present;
without it sliding layers are causal and full layers are not (both rules).
Full layers have no window: every position of the ring's window is visible.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import kernels

WINDOW_RULES = ("per_row", "anchored")

# The rule's bits of plan_lanes' ``masks`` argument, defined once in plan_mask.cuh.
_C = kernels.constants("plan_mask.cuh")
MASK_PER_ROW, MASK_CAUSAL_FULL, MASK_CAUSAL_SLIDING = (
    _C["PLAN_MASK_PER_ROW"], _C["PLAN_MASK_CAUSAL_FULL"], _C["PLAN_MASK_CAUSAL_SLIDING"])


@dataclass(frozen=True)
class MaskRule:
    """The mask rule of one drafter: ``window`` (sliding layers' W, 0: no limit),
    ``per_row`` (True: the per-row window; False: the seed's anchored one), and whether
    full and sliding layers are causal inside the block."""
    window: int = 0
    per_row: bool = True
    causal_full: bool = False
    causal_sliding: bool = True

    def __post_init__(self):
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 0:
            raise ValueError(f"MaskRule.window={self.window!r}: must be an int >= 0 (0: no limit)")
        for name in ("per_row", "causal_full", "causal_sliding"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MaskRule.{name} must be a bool, got {getattr(self, name)!r}")

    @classmethod
    def of(cls, rule) -> "MaskRule":
        """``rule`` itself, or for an int / None (a bare sliding window) the default rule
        with that window."""
        if isinstance(rule, MaskRule):
            return rule
        if rule is None:
            return cls()
        if isinstance(rule, bool) or not isinstance(rule, int):
            raise TypeError(f"mask rule must be a MaskRule or a sliding window (int), got {rule!r}")
        if rule < 0:
            raise ValueError(f"swa_window={rule}: must be >= 0 (0: no limit)")
        return cls(window=rule)

    @classmethod
    def for_config(cls, window: int, window_rule: str, is_causal) -> "MaskRule":
        """The rule of a config: ``window_rule`` in ``WINDOW_RULES``; ``is_causal`` None
        (sliding causal, full not) or a bool for every layer."""
        if window_rule not in WINDOW_RULES:
            raise ValueError(f"window_rule={window_rule!r}: must be one of {WINDOW_RULES}")
        causal_full, causal_sliding = (False, True) if is_causal is None else (is_causal, is_causal)
        return cls(int(window or 0), window_rule == "per_row", causal_full, causal_sliding)

    @property
    def flags(self) -> int:
        """The rule's bits of plan_lanes' ``masks`` argument."""
        return ((MASK_PER_ROW if self.per_row else 0) | (MASK_CAUSAL_FULL if self.causal_full else 0)
                | (MASK_CAUSAL_SLIDING if self.causal_sliding else 0))

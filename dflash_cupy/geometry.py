"""Ring-cache geometry (SPEC §3), shared by the cache, the kernels' options and the oracle."""
from __future__ import annotations

from dataclasses import dataclass

KV_ROW_ALIGN = 32  # cache rows are padded so masks/attention tiles never straddle the end
# The largest bulk-append chunk (rows per launch for a prefill, a jump or after
# a rewind) a DraftKvCache accepts; its bulk_chunk argument picks the size.
BULK_CHUNK = 1024


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


@dataclass(frozen=True)
class RingGeometry:
    """Row layout of one per-layer K or V cache:
    ``[0, slots)`` context ring (position p -> slot p % slots),
    ``[slots, slots+q_len)`` noise scratch, ``trash_slot`` for padded
    append rows, then padding up to ``kv_total``.

    ``capacity`` is the window (attention sees at most the last ``capacity``
    committed positions); ``slots = capacity + rewind_slack`` ring slots, so the
    ring also keeps the ``rewind_slack`` positions below the window: a rewind by
    at most that many positions finds every row of its window still cached."""
    capacity: int
    q_len: int
    rewind_slack: int = 0

    def __post_init__(self):
        for name in ("capacity", "q_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        v = self.rewind_slack
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"rewind_slack must be an int >= 0, got {v!r}")

    @property
    def slots(self) -> int:
        """Context ring slots (position p -> slot p % slots): the window plus the slack."""
        return self.capacity + self.rewind_slack

    @property
    def a_step(self) -> int:
        return 2 * self.q_len + 2

    @property
    def trash_slot(self) -> int:
        return self.slots + self.q_len

    @property
    def kv_total(self) -> int:
        return align_up(self.slots + self.q_len + 1, KV_ROW_ALIGN)

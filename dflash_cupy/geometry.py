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
    ``[0, capacity)`` context ring (position p -> slot p % capacity),
    ``[capacity, capacity+q_len)`` noise scratch, ``trash_slot`` for padded
    append rows, then padding up to ``kv_total``."""
    capacity: int
    q_len: int

    def __post_init__(self):
        for name in ("capacity", "q_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def a_step(self) -> int:
        return 2 * self.q_len + 2

    @property
    def trash_slot(self) -> int:
        return self.capacity + self.q_len

    @property
    def kv_total(self) -> int:
        return align_up(self.capacity + self.q_len + 1, KV_ROW_ALIGN)

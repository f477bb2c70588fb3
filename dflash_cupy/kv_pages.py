"""K/V pages: each layer's K (and V) cache is one pool of fixed-size pages shared by every
lane, and each lane maps its logical cache rows (``RingGeometry``'s layout, unchanged) to
physical rows through a page table: ``physical(lane, r) = table[lane, r // page] + r % page``
(``cuda_src/step_desc.cuh``'s ``page_row``). An entry holds the page's first physical row, so a
dense layout (lane ``i``'s rows at ``i*kv_total``) is a table too: one code path for both.

``page`` is a multiple of the attention's key tile (32 rows), so every key tile is one
contiguous piece of one page. Page 0 of a pool is shared: every logical page a lane does not
hold maps to it. Only keys the masks hide are ever read there, and the only rows written there
are a lane's trash slot and noise scratch while it holds no pages (padding, idle), finite.

``KvPages`` is the host allocator: a lane holds the pages under its ring slots ``[0,
min(committed, capacity))`` and its tail (noise scratch and trash slot); it takes pages as its
window grows (``plan``/``commit`` at ``begin_step``: O(1) per lane unless it crosses a page), and
gives them all back on reset; a reset in the step's plan (a rewind that empties the slot table)
shrinks it to its new window. ``usage()`` is the accounting record."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import int_arg

PAGE_ALIGN = 32   # the attention's key tile (attention_common.cuh TILE)
DEFAULT_PAGE = 64
SHARED_PAGE = 0


def check_page(page) -> int:
    """A page size in rows: a positive multiple of ``PAGE_ALIGN``."""
    page = int_arg(page, "page_size", 1)
    if page % PAGE_ALIGN:
        raise ValueError(f"page_size={page} must be a multiple of {PAGE_ALIGN} rows (the attention's key tile)")
    return page


def pages_per_lane(kv_total: int, page: int) -> int:
    """Page table entries per lane: the pages that cover ``kv_total`` logical rows."""
    return -(-kv_total // page)


def dense_table(lanes: int, kv_total: int, page: int, lane_stride: int | None = None) -> np.ndarray:
    """The table of a dense layout: lane ``i``'s logical row ``r`` at ``i*lane_stride + r``
    (default stride ``kv_total``): int32 ``[lanes, pages_per_lane]``."""
    stride = kv_total if lane_stride is None else lane_stride
    n = pages_per_lane(kv_total, page)
    t = np.arange(lanes, dtype=np.int64)[:, None] * stride + np.arange(n, dtype=np.int64)[None, :] * page
    if t.size and t.max() + page > 2**31:
        raise ValueError(f"lanes={lanes} x {stride} rows per lane overflow int32 row indices")
    return t.astype(np.int32)


def physical_rows(table_row, page: int, kv_total: int) -> np.ndarray:
    """Every logical row ``[0, kv_total)`` of one lane -> its physical row (NumPy, int64):
    the references read a paged cache through it."""
    r = np.arange(kv_total)
    return np.asarray(table_row, np.int64)[r // page] + r % page


def lane_pages(window: int, capacity: int, q_len: int, page: int) -> int:
    """Pages a lane holds at a window of ``window`` slots: the pages under ring slots
    ``[0, window)`` and its tail (the noise scratch and the trash slot, ``[capacity,
    capacity + q_len]``)."""
    ring = -(-min(window, capacity) // page)
    t0, t1 = capacity // page, (capacity + q_len) // page + 1
    return ring + (t1 - max(t0, ring))


def pool_bytes(lanes: int, capacity: int, q_len: int, row_bytes: int, pools: int, page: int = DEFAULT_PAGE,
               pages=None) -> int:
    """Bytes of an engine's K/V pools before anything is allocated: ``pools`` pools (``2 *
    n_layer``) of ``pages`` pages (default every lane's worst case) plus the shared page, of
    ``page`` rows of ``row_bytes`` (``kv_dim * 2``)."""
    page = check_page(page)
    n = lanes * lane_pages(capacity, capacity, q_len, page) if pages is None else int_arg(pages, "kv_pages", 1)
    return pools * (n + 1) * page * row_bytes


@dataclass(frozen=True)
class PagesUsage:
    """One page pool's accounting (one pool per layer and per K / V, all alike):
    ``page_rows`` rows per page, ``row_bytes`` bytes per row, ``pools`` pools
    (``2 * n_layer``), ``pages`` usable pages per pool (the shared page not counted),
    ``used``/``free`` of them, ``per_lane[i]`` pages lane ``i`` holds."""
    page_rows: int
    row_bytes: int
    pools: int
    pages: int
    used: int
    free: int
    per_lane: tuple

    @property
    def page_bytes(self) -> int:
        return self.page_rows * self.row_bytes

    @property
    def pool_bytes(self) -> int:
        """Bytes of one pool, the shared page included."""
        return (self.pages + 1) * self.page_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of every pool."""
        return self.pools * self.pool_bytes

    @property
    def used_bytes(self) -> int:
        return self.pools * self.used * self.page_bytes


class PagesRefused(RuntimeError):
    """A lane could not get the pages its step needs (nothing was changed)."""


class KvPages:
    """``KvPages(lanes, capacity, q_len, kv_total, page, pages=None)``: the page allocator
    of one engine (every pool has the same table). ``pages``: usable pages per pool (default:
    every lane's worst case, nothing ever refused). ``table`` int32 ``[lanes, pages_per_lane]``
    (row starts; unheld entries the shared page's 0) and ``version`` (bumped on every change)
    are what the engine uploads."""

    def __init__(self, lanes: int, capacity: int, q_len: int, kv_total: int, page: int, pages=None):
        self.lanes, self.capacity, self.q_len, self.kv_total = lanes, capacity, q_len, kv_total
        self.page = check_page(page)
        self.n = pages_per_lane(kv_total, page)
        # the tail: the pages under the noise scratch and the trash slot, held by an active lane
        self._tail0, self._tail1 = capacity // page, (capacity + q_len) // page + 1
        self.worst = lane_pages(capacity, capacity, q_len, self.page)
        pages = lanes * self.worst if pages is None else int_arg(pages, "kv_pages", 1)
        self.pages = pages
        if (pages + 1) * page >= 2**31:
            raise ValueError(f"kv_pages={pages} x page_size={page} rows overflow int32 row indices")
        self._free = list(range(pages, 0, -1))   # a stack: the lowest page is taken first
        self.table = np.zeros((lanes, self.n), np.int32)
        self._ring = [0] * lanes       # ring pages held: logical pages [0, ring)
        self._tail = [False] * lanes
        self._held = [0] * lanes
        self.version = 0

    def _need(self, window: int) -> int:
        return lane_pages(window, self.capacity, self.q_len, self.page)

    @property
    def free(self) -> int:
        return len(self._free)

    def held(self, lane: int) -> int:
        return self._held[lane]

    def plan(self, committed, resets=()) -> list:
        """The page changes of one step: ``committed[i]`` (an int, or ``None``: idle, keeps its
        pages), ``resets``: lanes whose slot table this step empties (they may shrink).
        Returns ``[(lane, ring_pages)]`` to ``commit``; raises ``PagesRefused`` naming the
        first lane that cannot get its pages and the shortfall, with nothing changed."""
        changes, net, first = [], 0, None
        p, cap = self.page, self.capacity
        for i, c in enumerate(committed):
            if c is None:
                continue
            ring = -(-min(c, cap) // p)
            grow = ring > self._ring[i] or not self._tail[i]
            if grow or (i in resets and ring != self._ring[i]):
                changes.append((i, ring))
                net += self._need(ring * p) - self._held[i]
                if first is None and net > self.free:
                    first = i
        if net > self.free:
            raise PagesRefused(f"lane {first} cannot get its K/V pages: this step needs {net} pages of {p} rows "
                               f"more than its lanes hold and {self.free} are free (shortfall {net - self.free} "
                               f"pages; the pool has {self.pages}, {self.pages - self.free} held; lanes changing "
                               f"pages: {[i for i, _ in changes]}): nothing was changed; reset a lane or build "
                               f"with more kv_pages")
        return changes

    def commit(self, changes) -> None:
        """Apply ``plan``'s changes: each lane gives back its pages, then takes its new ones
        (pages it keeps stay where they are: only the difference moves)."""
        for i, ring in changes:
            self._resize(i, ring, True)
        if changes:
            self.version += 1

    def release(self, lanes) -> None:
        """Lanes reset or gone: every page they hold goes back to the pool."""
        changed = False
        for i in lanes:
            if self._held[i]:
                self._resize(i, 0, False)
                changed = True
        if changed:
            self.version += 1

    def _resize(self, i: int, ring: int, tail: bool) -> None:
        """Lane ``i`` to hold ring pages ``[0, ring)`` and (``tail``) its tail pages: only the
        pages between the old and the new ring end, and the tail's, are looked at."""
        t0, t1, r0, h0 = self._tail0, self._tail1, self._ring[i], self._tail[i]
        row = self.table[i]
        for j in sorted(set(range(min(r0, ring), max(r0, ring))) | set(range(t0, t1))):
            had = j < r0 or (h0 and t0 <= j < t1)
            has = j < ring or (tail and t0 <= j < t1)
            if had and not has:
                self._free.append(int(row[j]) // self.page)
                row[j] = SHARED_PAGE
            elif has and not had:
                row[j] = self._free.pop() * self.page
        self._ring[i], self._tail[i] = ring, tail
        self._held[i] = ring + (t1 - max(t0, ring) if tail else 0)

    def usage(self, row_bytes: int, pools: int) -> PagesUsage:
        return PagesUsage(self.page, row_bytes, pools, self.pages, self.pages - self.free, self.free,
                          tuple(self._held))

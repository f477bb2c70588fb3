"""K/V pages (dflash_cupy/kv_pages.py): lanes sharing one small pool per layer, their pages
taken in shuffled order, equal single caches (each with its own pool, pages in order) bit for
bit through joins, idle steps, bulk prefills, wraparound, rewinds and resets (each twin also
checked against the float64 oracle); pages held in proportion to the live windows; a step whose
lanes cannot get their pages is refused at begin_step, naming the lane and the shortfall, with
nothing changed."""
from __future__ import annotations

import random

import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.kv_pages import KvPages, PagesRefused, dense_table, lane_pages, physical_rows, pool_bytes
from tests.support.drafters import SPECS, built
from tests.support.lanes import IDLE, make, play


def _expected_pages(c, cap, q_len, page):
    """Pages a lane at ``c`` committed holds: its ring prefix and its tail (noise scratch, trash),
    counted as sets (``lane_pages`` counts them in closed form)."""
    ring = -(-min(c, cap) // page)
    tail = set(range(cap // page, (cap + q_len) // page + 1))
    n = len(set(range(ring)) | tail)
    assert n == lane_pages(c, cap, q_len, page)
    return n


def _shuffle_pool(batch, seed):
    random.Random(seed).shuffle(batch.engine.kv_pages._free)


def test_allocator_grows_shrinks_and_refuses_without_change():
    p = KvPages(3, capacity=100, q_len=16, kv_total=128, page=32, pages=9)
    assert p.worst == 4 and p.n == 4                       # slots on pages 0-3, the tail on page 3
    p.commit(p.plan([10, None, 70]))
    assert [p.held(i) for i in range(3)] == [2, 0, 4] and p.free == 3
    before = (p.table.copy(), list(p._free), p.version)
    with pytest.raises(PagesRefused, match=r"lane 1 cannot get its K/V pages.*shortfall 2 pages"):
        p.plan([40, 90, None])                             # lane 0 +1, lane 1 +4: 5 > 3 free
    assert np.array_equal(p.table, before[0]) and p._free == before[1] and p.version == before[2]
    p.commit(p.plan([40, None, 20], resets={2}))           # lane 2's rewind empties its slot table: shrinks
    assert [p.held(i) for i in range(3)] == [3, 0, 2] and p.free == 4
    rows = [set(p.table[i][p.table[i] > 0] // 32) for i in (0, 2)]
    assert not rows[0] & rows[1] and 0 not in rows[0] | rows[1]   # distinct pages, never the shared one
    p.release([0, 2])
    assert p.free == 9 and not p.table.any()
    with pytest.raises(ValueError, match="page_size=40"):
        KvPages(1, 100, 16, 128, 40)


def test_dense_table_and_physical_rows():
    t = dense_table(3, 100, 64)
    assert t.tolist() == [[0, 64], [100, 164], [200, 264]]
    assert np.array_equal(physical_rows(t[2], 64, 100), 200 + np.arange(100))


def test_paged_lanes_equal_single_caches():
    """A pool of 40 pages for 3 lanes (their worst case is 48), taken in shuffled order:
    every active lane equals its twin (a single cache) bit for bit, through a late join with
    a bulk prefill, wraparound (jumps past the 491-slot window), a rewind that shrinks a lane
    and a reset that frees one."""
    be, batch, twins = make("e", 3, page_size=32, kv_pages=40)
    _shuffle_pool(batch, 7)
    cap, q = batch.capacity, batch.q_len
    schedule = [
        [40, IDLE, 5],
        [45, 100, 9],                  # lane 1 joins: a bulk prefill
        [IDLE, 104, 600],              # lane 2 jumps past its window: wraps around
        [48, ("rewind", 60), 603],     # lane 1 rewinds: its slot table emptied, its pages shrink
        [("reset", 7), 64, IDLE],      # lane 0 resets: its pages go back first
        [700, 66, 606],                # lane 0 jumps: 16 pages, the pool's last ones
        [703, IDLE, 609],
    ]
    held = []
    for ops in schedule:
        play(be, batch, twins, ops)
        held.append([batch.engine.kv_pages.held(i) for i in range(3)])
    nxt = batch.next_pos
    assert held[2] == [3, 5, 16] and held[3][1] == 3 and held[-1] == [16, 4, 16]
    assert held[-1] == [_expected_pages(c, cap, q, 32) for c in nxt]
    tables = be.to_numpy(batch.engine.page_table)
    assert np.array_equal(tables, batch.engine.kv_pages.table)
    owned = [set(t[t > 0].tolist()) for t in tables]
    assert sum(map(len, owned)) == len(set().union(*owned)) == 36     # no page held twice
    assert batch.captures == 2


def _drive(batch, c_all, rng):
    """One step with random features written where each lane needs them."""
    fc = batch.config.fc_in
    for i, c in enumerate(c_all):
        if c is None:
            continue
        ring = batch.rings[i]
        lo = max(0, c - batch.capacity)
        start = ring.hi if ring.lo <= lo <= ring.hi else lo
        if start < c:
            ring.write(start, rng.standard_normal((c - start, fc)).astype(np.float32))
    batch.step(c_all, rng.standard_normal((batch.lanes, batch.q_len, batch.config.hidden_size)).astype(np.float32))


def _batch(lanes, **kw):
    s = SPECS["e"]
    w, _ = built("e")
    return DraftKvBatch(w, s.capacity, lanes, ring_capacity=s.ring_capacity, ring_dtype=s.ring_dtype,
                        backend=backends.get("emulated"), bulk_chunk=s.bulk_chunk, page_size=32, **kw)


def test_short_and_long_requests_hold_pages_in_proportion():
    """Short and long requests in one batch: each lane holds its window's pages and its tail,
    so the pool's use follows the sum of the live windows (at most two pages of slack per
    lane), not lanes x the worst case."""
    rng = np.random.default_rng(5)
    batch = _batch(6)
    cap, q, page = batch.capacity, batch.q_len, 32
    committed = [5, 40, 200, 600, None, 33]
    _drive(batch, committed, rng)
    m = batch.kv_memory()
    want = [0 if c is None else _expected_pages(c, cap, q, page) for c in committed]
    assert list(m.per_lane) == want == [2, 3, 8, 16, 0, 3]
    assert m.used == sum(want) == 32 and m.pages == 6 * 16 and m.free == m.pages - 32
    live = sum(min(c, cap) for c in committed if c is not None)
    assert 0 <= m.used * page - live <= 2 * page * 5
    kv_row = batch.config.kv_dim * 2
    assert m.pools == 2 * batch.config.n_layer and m.row_bytes == kv_row
    assert m.pool_bytes == (m.pages + 1) * page * kv_row == batch.engine.k_cache[0].nbytes
    assert m.total_bytes == pool_bytes(6, cap, q, kv_row, m.pools, page) == sum(
        a.nbytes for a in batch.engine.k_cache + batch.engine.v_cache)
    assert m.used_bytes == m.pools * 32 * page * kv_row
    batch.reset(3)
    assert batch.kv_memory().per_lane[3] == 0 and batch.kv_memory().used == 16


def test_a_lane_without_pages_is_refused_with_nothing_changed():
    rng = np.random.default_rng(6)
    batch = _batch(2, kv_pages=20)
    be, e = batch.backend, batch.engine
    _drive(batch, [400, 5], rng)                       # 14 pages, 2 pages: 4 free
    ring = batch.rings[1]
    ring.write(ring.hi, rng.standard_normal((300 - ring.hi, batch.config.fc_in)).astype(np.float32))
    before = (list(batch.next_pos), be.to_numpy(batch.slot_pos).copy(), e.kv_pages.table.copy(),
              list(e.kv_pages._free), be.to_numpy(e.page_table).copy(), e._slot, batch.captures)
    with pytest.raises(PagesRefused, match=r"lane 1 cannot get its K/V pages.*shortfall 5 pages"):
        batch.begin_step([None, 300])                 # lane 1 needs 11: 9 more, 4 free
    after = (list(batch.next_pos), be.to_numpy(batch.slot_pos), e.kv_pages.table, list(e.kv_pages._free),
             be.to_numpy(e.page_table), e._slot, batch.captures)
    for x, y in zip(before, after):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(RuntimeError, match="needs a planned step"):
        batch.run()
    batch.reset(0)                                    # lane 0's pages back to the pool
    _drive(batch, [None, 300], rng)
    assert batch.kv_memory().per_lane == (0, 11)


def test_paged_lanes_random_schedules_equal_single_caches():
    """Seeded random schedules (growth, idle steps, rewinds, jumps past the window, resets) of 3
    lanes sharing 26 pages (their worst case is 48), taken in shuffled order: every active lane
    equals its twin bit for bit at every step. A step the pool cannot hold (found on a copy of
    the allocator) first resets its largest lane to a short request, as a server would evict."""
    import copy
    rng = np.random.default_rng(11)
    be, batch, twins = make("e", 3, page_size=32, kv_pages=26)
    _shuffle_pool(batch, 3)
    pages, cap, q = batch.engine.kv_pages, batch.capacity, batch.q_len
    cur, evicted, peak = [0] * 3, 0, 0
    for _ in range(12):
        ops = []
        for i in range(3):
            kind = rng.choice(["grow", "grow", "idle", "rewind", "jump", "reset"])
            if kind == "idle" or (kind == "rewind" and cur[i] <= 1):
                ops.append(IDLE)
            elif kind == "grow" or cur[i] == 0:
                ops.append(cur[i] + int(rng.integers(1, q + 2)))
            elif kind == "rewind":
                ops.append(("rewind", int(rng.integers(1, cur[i]))))
            elif kind == "jump":
                ops.append(cur[i] + int(rng.integers(batch.a_step + 1, batch.a_step + 2 * cap)))
            else:
                ops.append(("reset", int(rng.integers(1, 2 * cap))))
        while True:
            sim = copy.deepcopy(pages)
            sim.release([i for i, o in enumerate(ops) if isinstance(o, tuple) and o[0] == "reset"])
            try:
                sim.plan([None if o is IDLE else (o[1] if isinstance(o, tuple) else o) for o in ops])
                break
            except PagesRefused:
                big = [i for i, o in enumerate(ops) if o is not IDLE and not (isinstance(o, tuple) and o[1] <= q + 1)]
                i = max(big, key=lambda i: pages.held(i) if not isinstance(ops[i], tuple) or ops[i][0] != "reset"
                        else sim._need(min(ops[i][1], cap)))
                ops[i] = ("reset", int(rng.integers(1, q + 2)))
                evicted += 1
        play(be, batch, twins, ops)
        for i, o in enumerate(ops):
            if o is not IDLE:
                cur[i] = o[1] if isinstance(o, tuple) else o
        held = [pages.held(i) for i in range(3)]
        peak = max(peak, sum(held))
        assert sum(held) == pages.pages - pages.free <= 26
        owned = [set(t[t > 0].tolist()) for t in be.to_numpy(batch.engine.page_table)]
        assert sum(map(len, owned)) == len(set().union(*owned)) == sum(held)
    assert batch.captures == 2
    assert evicted >= 1 and peak >= 20, (evicted, peak)   # the schedule did fill the pool


def test_bad_pool_arguments_raise():
    with pytest.raises(ValueError, match="page_size=48 must be a multiple of 32"):
        DraftKvBatch(built("e")[0], 491, 2, backend=backends.get("emulated"), page_size=48)
    with pytest.raises(ValueError, match="kv_pages"):
        DraftKvBatch(built("e")[0], 491, 2, backend=backends.get("emulated"), kv_pages=0)
    with pytest.raises(ValueError, match="overflow int32"):
        KvPages(1, 100, 16, 128, 2**20, pages=2**12)


def test_the_page_table_is_uploaded_only_when_pages_change():
    rng = np.random.default_rng(8)
    batch = _batch(2)
    staging = batch.engine._pages_staging
    copies = []
    real = staging.copy
    staging.copy = lambda *a: (copies.append(1), real(*a))
    for c_all, want in (([5, None], 1), ([9, None], 0), ([13, 4], 1), ([17, 8], 0), ([40, 12], 1), ([44, 16], 0)):
        n = len(copies)
        _drive(batch, c_all, rng)
        assert len(copies) - n == want, c_all   # a lane's first page / a page boundary crossed (32 rows)
    batch.reset(0)
    _drive(batch, [None, 20], rng)
    assert len(copies) == 4 and batch.kv_memory().per_lane == (0, 2)

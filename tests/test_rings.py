"""Rewind slack, feature rings smaller than the window, streaming prefill (issue 28, item 2).

* the host planner's bookkeeping against a brute-force model of the K/V ring (every slot's
  position and feature version): what the masks show is exactly the window, current;
* ``RingDriver`` schedules (growth, wraparound, rewinds within and beyond the slack, rewinds
  right after a jump, jumps, resets, large positions) against the float64 oracle, with rings
  as small as 3 rows: deeper rewinds without features are refused with nothing changed, then
  re-prefilled;
* a lane of a batch with a slack equals a single cache with it, bit for bit;
* streaming prefill against appending the prompt at once (bits) and the oracle.
"""
from __future__ import annotations

import zlib
from collections import Counter

import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.geometry import RingGeometry
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.ops.ring_slots import plan_append_reference
from dflash_cupy.ops.step_descriptor import DESC_LEN, DESC_N_NEW, DESC_START, decide_lanes
from dflash_cupy.reference import ring_masks
from tests.support.drafters import SPECS, Driver, built
from tests.support.lanes import play

P20 = 2**20


# --------------------------------------------------------------------------- 1. the planner, brute force
class _Ring:
    """A feature ring stand-in: holds ``[lo, hi)``."""
    _closed = False

    def __init__(self, lo=0, hi=1 << 40):
        self.lo, self.hi = lo, hi


def _planned_slots(sp, vals, lane, geom, reset):
    """The slot table after the step (plan_append_reference on the in-graph / bulk rows)."""
    if reset:
        sp[:] = -1
    d = np.array(vals[lane * DESC_LEN:(lane + 1) * DESC_LEN], np.int64)
    return plan_append_reference(d, sp, int(d[DESC_N_NEW]), geom, with_noise=False)[2]


@pytest.mark.parametrize("cap,slack", [(1, 3), (3, 1), (19, 19), (33, 5), (3, 0), (19, 0)])
def test_planner_shows_exactly_the_current_window(cap, slack):
    """Random schedules (grow, jump, rewind by 1..2*slots, reset) over one lane: after every
    step the slots the masks show (lo <= slot_pos < committed) are exactly the window
    [lo, committed), each holding its current feature version; rewinds the K/V ring covers
    append nothing, and with slack 0 every rewind resets."""
    geom = RingGeometry(cap, 2, slack)
    rng = np.random.default_rng(cap * 100 + slack)
    S = geom.slots
    counts = Counter()
    for _ in range(40):
        sp = np.full(S, -1, np.int64)
        ver = np.zeros(S, np.int64)      # feature version each slot's row was made from
        cur: dict = {}                   # position -> current version (rewinds bump it)
        nxt, kv_lo, c = 0, 0, 0
        for _ in range(30):
            r = rng.random()
            if c == 0 or r < 0.4:
                v = c + int(rng.integers(1, 2 * geom.a_step))
            elif r < 0.5:
                v = c + int(rng.integers(1, 3 * S + 2))
            elif r < 0.95:
                v = max(1, c - int(rng.integers(1, 2 * S + 1)))
            else:
                sp[:], nxt, kv_lo, v = -1, 0, 0, int(rng.integers(1, S + 3))
                cur = {}
            if v < c:
                for p in range(v, c + 1):   # new tokens from v on: new features
                    cur[p] = cur.get(p, 0) + 1
            plan = decide_lanes([v], [nxt], [_Ring()], geom, kv_lo=[kv_lo])
            f = plan.fields(0)
            lo = v - min(v, cap)
            if nxt > v:
                counts["reset" if f.reset else "hide"] += 1
                if slack == 0:
                    assert f.reset
            vals = list(plan.vals)
            if f.bulk_count:   # the bulk rows, as the step engine appends them
                vals[DESC_START::DESC_LEN], vals[DESC_N_NEW::DESC_LEN] = [f.bulk_start], [f.bulk_count]
            sp = _planned_slots(sp, vals, 0, geom, f.reset)
            start = f.bulk_start if f.bulk_count else f.start
            for p in range(start, start + max(f.n_new, f.bulk_count)):
                ver[p % S] = cur.get(p, 0)
            for i, p in plan.restart:
                kv_lo = p
            nxt, c = v, v
            shown = (sp >= lo) & (sp < v)
            assert sorted(sp[shown].tolist()) == list(range(lo, v)), (cap, slack, v)
            assert all(ver[s] == cur.get(int(sp[s]), 0) for s in np.flatnonzero(shown)), (cap, slack, v)
            mf, _ = ring_masks(sp, v, geom, 0)
            assert (mf[0, :S] == 0).tolist() == shown.tolist()
    assert counts["reset"] > 0 and (slack == 0 or counts["hide"] > 0), counts


# --------------------------------------------------------------------------- 2. schedules vs the oracle
class RingDriver(Driver):
    """A ``Driver`` whose cache has ``rewind_slack`` and whose feature ring has
    ``ring_capacity`` rows (maybe far fewer than the window). It writes only the rows the
    cache will append; rows that do not fit the ring stream through ``prefill``; a rewind
    deeper than the K/V ring covers, whose rows the ring lacks, must be refused with nothing
    changed (``check_refusal``), and is then re-prefilled (``reset`` + ``prefill``)."""

    def __init__(self, be, name, *, slack, ring_capacity=None, base=0, seed=0):
        self.be, self.name, self.spec = be, name, SPECS[name]
        self.x_split = True
        s, c = self.spec, self.spec.config
        self.w, self.lm = built(name)
        self.kv = DraftKvCache(self.w, s.capacity, lm_head=self.lm, backend=be, bulk_chunk=s.bulk_chunk,
                               rewind_slack=slack)
        self.ring = FeatureRing(ring_capacity or s.ring_capacity, c.n_captured, c.hidden_size, s.ring_dtype,
                                backend=be)
        self.rng = np.random.default_rng(seed)
        self.cap, self.q, self.slack = s.capacity, c.q_len, slack
        self.slots = s.capacity + slack
        self.origin = max(0, base - s.capacity - slack)
        self.floor = max(1, base)
        self.hist = np.zeros((0, c.fc_in), np.float32)
        self.valid_hi = 0
        self.sp = np.full(self.slots, -1, np.int64)
        self.next_pos = self.kv_lo = 0
        self.committed = None
        self.stats = Counter()

    def reset(self):
        super().reset()
        self.kv_lo = 0

    def decide(self, c):
        """SPEC §3 step 1-2 with the slack: (kind, first position appended)."""
        n, lo = self.next_pos, c - min(c, self.cap)
        if n > c:
            if self.slack and max(self.kv_lo, n - self.slots) <= lo:
                return "hide", c
            return "reset", lo
        return ("jump" if lo > n else "grow"), max(n, lo)

    def model(self, c):
        kind, start = self.decide(c)
        if kind == "reset":
            self.sp[:] = -1
        if kind in ("reset", "jump"):
            self.kv_lo = start
        if kind in ("hide", "reset") or self.next_pos != c:
            self.stats[kind] += 1
        for p in range(start, c):
            self.sp[p % self.slots] = p
        self.next_pos = c

    def write(self, s, c):
        self.ring.write(s, self.features(s, c))

    def feed(self, c):
        kind, start = self.decide(c)
        if start >= c:
            return
        good = min(self.ring.hi, self.valid_hi)
        s = good if self.ring.lo <= start <= good else start
        if c - s <= self.ring.capacity:
            if s < c:
                self.write(s, c)
            self.valid_hi = max(self.valid_hi, c)
            return
        if kind == "reset":   # the rows are gone from the ring: refused, then a re-prefill
            self.check_refusal(c, start)
            self.kv.reset()
            self.ring.reset()
            self.sp[:] = -1
            self.next_pos = self.kv_lo = 0
            self.stats["re-prefill"] += 1
        self.stats["prefill"] += 1
        self.kv.prefill(self.ring, self.features(start, c), start=None if start == self.next_pos else start)
        self.valid_hi = c
        self.model(c)

    def check_refusal(self, c, start):
        kv, be = self.kv, self.be
        before = (kv.next_pos, be.to_numpy(kv.slot_pos).copy(), be.to_numpy(kv.k_cache[0]).copy(),
                  be.to_numpy(kv.v_cache[-1]).copy(), self.ring.lo, self.ring.hi, kv._planned)
        with pytest.raises(KeyError, match=rf"positions \[{start}, {c}\).*missing.*re-prefill"):
            kv.begin_step(self.ring, c)
        after = (kv.next_pos, be.to_numpy(kv.slot_pos), be.to_numpy(kv.k_cache[0]), be.to_numpy(kv.v_cache[-1]),
                 self.ring.lo, self.ring.hi, kv._planned)
        assert before[0] == after[0] and before[4:] == after[4:]
        for a, b in zip(before[1:4], after[1:4]):
            assert np.array_equal(a, b)
        self.stats["refused"] += 1


def slack_ops(cap, q, slack):
    """Growth, wraparound past the slots, rewinds by 1 and by exactly the slack (no reset),
    by slack + 1 (reset), a rewind right after a jump (the jump's rows start the run: reset),
    a jump over the whole ring, a reset and growth again."""
    A = 2 * q + 2
    S = cap + slack
    c, ops = 1, [1]
    for d in (q, A, A + 1, 1):
        c += d
        ops.append(c)
    c = max(c + 1, S + 3)
    ops += [c, c + 1]
    c += 1
    ops += [("rewind", c - 1), c - 1 + q]
    c += q - 1
    ops += [("rewind", c - slack), c - slack + 1, c - slack + 1 + A]
    c += A + 1 - slack
    ops += [("rewind", max(1, c - slack - 1)), c + 2]
    c += 2
    ops += [c + 2 * S + 5]
    c += 2 * S + 5
    ops += [("rewind", c - 1), c + 1, ("rewind", c), c + q]
    ops += ["reset", 3, ("rewind", 2), 3 + q, ("eager", 4 + q)]
    return ops


@pytest.mark.parametrize("name,slack,ring_capacity,base", [
    ("a", 3, None, 0),           # slack, full feature ring (cap 23, ring 25)
    ("a", 1, 4, P20 - 7),        # ring of 4 rows for a window of 23
    ("b", 19, 3, 0),             # cap 5, block 8: slack 19, ring 3
    ("c", 33, 1, 2**31 - 300),   # cap 13, block 1: ring of 1 row, positions near 2^31
    ("g", 5, 7, 0),              # DFlash 2 (convolutions, selector)
])
def test_slack_schedule_matches_oracle(backend, name, slack, ring_capacity, base):
    s = SPECS[name]
    d = RingDriver(backend, name, slack=slack, ring_capacity=ring_capacity, base=base,
                   seed=zlib.crc32(f"{name}{slack}{base}".encode()))
    try:
        d.run_ops(slack_ops(s.capacity, s.config.q_len, slack))
    finally:
        d.close()
    st = d.stats
    print(f"{name} slack={slack} ring={d.ring.capacity}: {dict(st)}")
    assert st["hide"] >= 2 and st["reset"] + st["re-prefill"] >= 2, st
    if ring_capacity is not None and ring_capacity < s.capacity:
        assert st["refused"] >= 1 and st["prefill"] >= 2, st


# --------------------------------------------------------------------------- 3. lanes = single caches
class RingTwin(RingDriver):
    """A ``RingDriver`` mirrored into one lane of a batch (full feature rings: no prefill)."""

    def __init__(self, be, name, batch, lane, seed):
        super().__init__(be, name, slack=batch.geom.rewind_slack, seed=seed)
        self.batch, self.lane = batch, lane

    def write(self, s, c):
        super().write(s, c)
        self.batch.rings[self.lane].write(s, self.features(s, c))

    def reset(self):
        super().reset()
        self.batch.reset(self.lane)
        self.batch.rings[self.lane].reset()


def test_lanes_with_slack_equal_single_caches_bitwise():
    """Three lanes of a batch with rewind_slack=4, each against a single cache with it (and the
    oracle): rewinds within the slack, beyond it, after a jump, idle steps."""
    from dflash_cupy.kv_batch import DraftKvBatch
    be = backends.get("emulated")
    s = SPECS["a"]
    w, lm = built("a")
    batch = DraftKvBatch(w, s.capacity, 3, ring_capacity=s.ring_capacity, ring_dtype=s.ring_dtype, lm_head=lm,
                         backend=be, bulk_chunk=s.bulk_chunk, rewind_slack=4)
    twins = [RingTwin(be, "a", batch, i, seed=300 + i) for i in range(3)]
    try:
        sched = [[5, 1, None], [27, 2, 3], [31, None, 13], [("rewind", 28), 12, 24],
                 [29, ("rewind", 7), ("rewind", 21)], [("rewind", 24), 8, 30], [26, 70, ("rewind", 27)],
                 [None, ("rewind", 69), 60], [27, 71, ("rewind", 59)]]
        for ops in sched:
            play(be, batch, twins, ops)
        hides = sum(t.stats["hide"] for t in twins)
        resets = sum(t.stats["reset"] for t in twins)
        assert hides >= 4 and resets >= 1, [t.stats for t in twins]
    finally:
        batch.close()
        for t in twins:
            t.close()

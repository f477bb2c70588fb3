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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_cupy import backends, reference
from dflash_cupy.feature_ring import FeatureRing
from dflash_cupy.geometry import RingGeometry
from dflash_cupy.kv_cache import DraftKvCache
from dflash_cupy.ops.ring_slots import plan_append_reference
from dflash_cupy.ops.step_descriptor import DESC_LEN, DESC_N_NEW, DESC_START, decide_lanes
from dflash_cupy.reference import ring_masks
from tests.support.drafters import SPECS, Driver, built
from tests.support.lanes import play
from tests.support.tolerances import assert_close

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


@st.composite
def ring_scenarios(draw):
    name = draw(st.sampled_from(("a", "b", "c", "a", "b", "c", "g")))
    s = SPECS[name]
    cap, q = s.capacity, s.config.q_len
    A = 2 * q + 2
    slack = draw(st.sampled_from([1, 3, 19, 33]))
    ring_capacity = draw(st.sampled_from([None, 1, 3, 19]))   # None: the drafter's (>= the window)
    S = cap + slack
    op = st.one_of(
        st.tuples(st.just("accept"), st.integers(1, q)),
        st.tuples(st.just("grow"), st.integers(0, A)),
        st.tuples(st.just("jump"), st.integers(A + 1, A + 2 * S + 3)),
        st.tuples(st.just("rewind"), st.integers(1, 2 * S + q)),
        st.tuples(st.just("reset"), st.integers(1, cap + A + 2)),
    )
    ops = draw(st.lists(st.tuples(op, st.booleans()), min_size=2, max_size=7))
    return (name, slack, ring_capacity, draw(st.sampled_from([0, 0, P20 - 5])),
            draw(st.integers(1, cap + A + 2)), ops, draw(st.integers(0, 2**16)))


@pytest.mark.slow
@settings(max_examples=30, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=ring_scenarios())
def test_slack_property(scenario):
    """Drawn schedules (slack 1..33, feature rings of 1..19 rows or the window's) against the
    oracle, as ``test_kv_cache.test_invariant_property`` with the slack's model."""
    name, slack, ring_capacity, base, first, ops, seed = scenario
    d = RingDriver(backends.get("emulated"), name, slack=slack, ring_capacity=ring_capacity, base=base, seed=seed)
    try:
        d.run_drawn(first, ops)
    finally:
        d.close()


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


_SLACK_LANES = {
    # drafter a (window 23): rewinds within the slack, beyond it, after a jump, idle steps
    ("a", 4): [[5, 1, None], [27, 2, 3], [31, None, 13], [("rewind", 28), 12, 24],
               [29, ("rewind", 7), ("rewind", 21)], [("rewind", 24), 8, 30], [26, 70, ("rewind", 27)],
               [None, ("rewind", 69), 60], [27, 71, ("rewind", 59)]],
    # drafter e (window 491) on a small shared pool of 32-row pages taken in shuffled order:
    # lanes crossing pages, jumps past the window (wraparound), rewinds within the slack of 9
    # (no reset, no pages given back) and beyond it (a reset: the lane shrinks)
    ("e", 9): [[40, None, 5], [45, 100, 9], [None, 104, 600], [48, ("rewind", 97), 603],
               [("rewind", 40), 103, ("rewind", 596)], [44, 700, 598], [46, ("rewind", 695), 1200],
               [("rewind", 20), 699, ("rewind", 1193)], [25, 703, 1197]],
}


@pytest.mark.parametrize("name,slack", list(_SLACK_LANES))
def test_lanes_with_slack_equal_single_caches_bitwise(name, slack):
    """Three lanes of a batch with a rewind slack, each against a single cache with it (and the
    oracle), bit for bit (``_SLACK_LANES``' schedules)."""
    import random
    from dflash_cupy.kv_batch import DraftKvBatch
    be = backends.get("emulated")
    s = SPECS[name]
    w, lm = built(name)
    pool = dict(page_size=32, kv_pages=45) if name == "e" else {}
    batch = DraftKvBatch(w, s.capacity, 3, ring_capacity=s.ring_capacity, ring_dtype=s.ring_dtype, lm_head=lm,
                         backend=be, bulk_chunk=s.bulk_chunk, rewind_slack=slack, **pool)
    if pool:
        random.Random(5).shuffle(batch.engine.kv_pages._free)
    twins = [RingTwin(be, name, batch, i, seed=300 + i) for i in range(3)]
    try:
        for ops in _SLACK_LANES[name, slack]:
            play(be, batch, twins, ops)
        hides = sum(t.stats["hide"] for t in twins)
        resets = sum(t.stats["reset"] for t in twins)
        assert hides >= 3 and resets >= 1, [t.stats for t in twins]
    finally:
        batch.close()
        for t in twins:
            t.close()


# --------------------------------------------------------------------------- 4. a rewind within the slack
def _shared(d0, d1):
    """``d0`` reads ``d1``'s features and both the noise the test sets in the returned dict."""
    d0.features = d1.features
    d0.forget_from = lambda p: setattr(d0, "valid_hi", min(d0.valid_hi, p))
    cur = {}
    d1.noise = d0.noise = lambda: cur["noise"]
    return cur


@pytest.mark.parametrize("name,slack", [("a", 3), ("b", 19), ("c", 1)])
def test_rewind_within_slack_equals_never_appending(name, slack):
    """A rewind within the slack hides the rewound rows and appends nothing: every later
    step is bit for bit the step of a cache (same slack) that never appended them, its
    masks included; both match the oracle. (Against slack 0 only the oracle's tolerance
    holds: the slots, hence the order the attention reads keys in, differ; measured
    max |slack 3 - slack 0| = 2.4e-5 on drafter a's slack_ops.)"""
    be = backends.get("emulated")
    s = SPECS[name]
    q, A = s.config.q_len, 2 * s.config.q_len + 2
    # growth by at most the window per step keeps the rows one run (a jump would restart it)
    X = s.capacity + slack + 3
    r = min(slack, s.capacity)
    Y = X + 1 + min(A, s.capacity)
    # (A's op, B's op): B skips what A appends and then rewinds over
    pairs = [(1, 1), (1 + q, 1 + q), (X, X), (X + min(slack, A, s.capacity), None), (("rewind", X), X),
             (X + 1, X + 1), (Y, None), (("rewind", Y - r), Y - r), (Y - r + q, Y - r + q)]
    da = RingDriver(be, name, slack=slack, seed=11)
    db = RingDriver(be, name, slack=slack, seed=11)
    cur = _shared(db, da)
    nr = np.random.default_rng(12)
    try:
        for op_a, op_b in pairs:
            cur["noise"] = nr.standard_normal((q, s.config.hidden_size)).astype(np.float32)
            da.run_ops([op_a])
            if op_b is None:
                continue
            db.run_ops([op_b])
            what = f"{name}: {op_a} / {op_b}"
            for n in ("hidden_states", "logits", "mask_full", "mask_swa"):
                a, b = getattr(da.kv, n), getattr(db.kv, n)
                if a is not None:
                    assert np.array_equal(be.to_numpy(a).view(np.uint8), be.to_numpy(b).view(np.uint8)), \
                        f"{what}: {n}"
        assert da.stats["hide"] == 2 and db.stats["hide"] == 0, (da.stats, db.stats)
    finally:
        da.close()
        db.close()


# --------------------------------------------------------------------------- 5. streaming prefill
def _window_rows(kv, be, lo, c):
    """Every layer's K and V rows of positions [lo, c) (their slots through the page table)."""
    from dflash_cupy.kv_pages import physical_rows
    phys = physical_rows(be.to_numpy(kv.engine.page_table)[0], kv.engine.page, kv.geom.kv_total)
    sl = phys[[p % kv.geom.slots for p in range(lo, c)]]
    return [be.to_numpy(a)[sl] for a in (*kv.k_cache, *kv.v_cache)]


@pytest.mark.parametrize("name,prompt,ring_caps,base", [
    ("a", 60, (4, 23, 7), 0),        # cap 23: the prompt is 2.6 windows, rings of 4, 7, 23 rows
    ("a", 9, (3,), 0),               # within a_step: the one-shot appends it inside the step
    ("a", 30, (3,), P20 - 5),        # a prompt from position 2^20 - 5 (start=): a jump onto the window
    ("e", 1000, (128, 50), 0),       # cap 491, bulk_chunk 64: aligned chunks (128) and not (50)
    ("c", 40, (1,), 2**31 - 100),    # a 1-row ring, positions near 2^31
])
def test_streaming_prefill_equals_appending_at_once(name, prompt, ring_caps, base):
    """``prefill`` through rings far smaller than the prompt equals writing the last window
    into a full ring and appending it at once (``begin_step``): the window's K/V rows and
    the step's outputs bit for bit (on the emulator: each row's K/V does not depend on which
    rows share its launch), and the oracle."""
    be = backends.get("emulated")
    s = SPECS[name]
    c = s.config
    w, lm = built(name)
    rng = np.random.default_rng(prompt)
    X = rng.standard_normal((prompt, c.fc_in)).astype(np.float32)
    noise = rng.standard_normal((c.q_len, c.hidden_size)).astype(np.float32)
    P = base + prompt
    lo = P - min(P, s.capacity)
    one = DraftKvCache(w, s.capacity, lm_head=lm, backend=be, bulk_chunk=s.bulk_chunk)
    full = FeatureRing(max(s.ring_capacity, s.capacity), c.n_captured, c.hidden_size, s.ring_dtype, backend=be)
    try:
        full.write(lo, X[lo - base:])
        want = be.to_numpy(one.step(full, P, noise)).copy()
        want_kv = _window_rows(one, be, lo, P)
        ref = reference_hidden(w, lm, X[lo - base:].astype(full.dtype), noise, lo)
        for rc in ring_caps:
            kv = DraftKvCache(w, s.capacity, lm_head=lm, backend=be, bulk_chunk=s.bulk_chunk, rewind_slack=2)
            ring = FeatureRing(rc, c.n_captured, c.hidden_size, s.ring_dtype, backend=be)
            try:
                rows = be.asarray(X.astype(ring.dtype)) if rc == 7 else X   # device rows too
                kv.prefill(ring, rows, start=None if base == 0 else base)
                assert kv.next_pos == P and (ring.lo, ring.hi) == (P - min(rc, s.capacity, prompt), P)
                kv.begin_step(ring, P)
                assert kv.last_plan.n_new == 0 and kv.last_plan.bulk_count == 0
                got_kv = _window_rows(kv, be, lo, P)
                assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(got_kv, want_kv)), rc
                kv.set_noise_embed(noise)
                got = be.to_numpy(kv.run())
                assert_close(got, ref, "step", f"{name} prompt {prompt} ring {rc}")
                # the slack moves the noise rows: bits equal the one-shot only at slack 0
                assert float(np.abs(got - want).max()) < 1e-4
            finally:
                kv.close()
                ring.close()
    finally:
        one.close()
        full.close()


def reference_hidden(w, lm, X, noise, lo):
    out = reference.draft_forward(w, X, noise, lm_head=lm, pos_offset=lo)
    return out[0] if lm is not None else out


# --------------------------------------------------------------------------- 6. the batch's prefill / append
def test_batch_prefill_and_append_equal_single_caches_and_refuse_cleanly():
    """Lanes of a batch (4-row feature rings for a 23-position window, slack 2) filled by
    ``prefill`` (50 rows) and by alternating ``rings[i].write`` / ``append`` equal single
    caches filled the same way, bit for bit; bad calls raise naming the problem and change
    nothing (positions, slot tables, rings), and the batch goes on."""
    from dflash_cupy.kv_batch import DraftKvBatch
    be = backends.get("emulated")
    s = SPECS["a"]
    c = s.config
    w, lm = built("a")
    rng = np.random.default_rng(28)
    X = [rng.standard_normal((n, c.fc_in)).astype(np.float32) for n in (7, 50)]
    noise = rng.standard_normal((3, c.q_len, c.hidden_size)).astype(np.float32)
    kw = dict(lm_head=lm, backend=be, bulk_chunk=s.bulk_chunk, rewind_slack=2)
    batch = DraftKvBatch(w, s.capacity, 3, ring_capacity=4, **kw)
    singles = [DraftKvCache(w, s.capacity, **kw) for _ in range(2)]
    rings = [FeatureRing(4, c.n_captured, c.hidden_size, backend=be) for _ in range(2)]
    try:
        for p in range(0, 7, 3):            # lane 0: the caller alternates write / append
            batch.rings[0].write(p, X[0][p:p + 3])
            batch.append([min(p + 3, 7), None, None])
            rings[0].write(p, X[0][p:p + 3])
            singles[0].append(rings[0], min(p + 3, 7))
        batch.prefill(1, X[1])
        singles[1].prefill(rings[1], X[1])
        assert batch.next_pos == [7, 50, 0]
        out = be.to_numpy(batch.step([7, 50, None], noise))
        for i in range(2):
            h = be.to_numpy(singles[i].step(rings[i], [7, 50][i], noise[i]))
            assert np.array_equal(out[i], h), i
            assert np.array_equal(be.to_numpy(batch.slot_pos)[i], be.to_numpy(singles[i].slot_pos)), i
        # ---- bad calls change nothing
        def state():
            return (batch.next_pos, be.to_numpy(batch.slot_pos).tolist(), be.to_numpy(batch.k_cache[0]).tobytes(),
                    [(r.lo, r.hi) for r in batch.rings])
        before = state()
        bad = X[1][:5].copy()
        bad[3, 2] = np.nan
        with pytest.raises(ValueError, match=r"rows\[3, 2\]"):
            batch.prefill(1, bad)
        with pytest.raises(ValueError, match="start=3 is behind next_pos=7"):
            batch.prefill(0, X[1][:5], start=3)
        with pytest.raises(ValueError, match="start=100 is ahead of next_pos=7"):
            batch.prefill(0, X[1][:5], start=100)
        with pytest.raises(ValueError, match=r"rows must have shape \[n, "):
            batch.prefill(0, X[1][:, :5])
        with pytest.raises(ValueError, match="lane=3"):
            batch.prefill(3, X[1])
        with pytest.raises(KeyError, match=r"lane 1: .*missing \[50, 60\)"):
            batch.append([None, 60, None])
        with pytest.raises(KeyError, match=r"lane 1: .*missing \[24, 46\).*rewind_slack=2"):
            batch.begin_step([None, 47, None])   # a rewind by 3 > slack, its rows gone from the ring
        assert state() == before
        # rewinds the K/V ring covers: by 2 = the slack (the prefill kept the slack's rows), and
        # any rewind of a window that has not slid yet; nothing appended, no feature rows read
        batch.begin_step([3, 48, None])
        assert [(f.n_new, f.reset) for f in batch.last_plan[:2]] == [(0, False), (0, False)]
        batch.run()
        assert batch.next_pos == [3, 48, 0]
    finally:
        batch.close()
        for x in (*singles, *rings):
            x.close()


def test_cache_prefill_and_append_refuse_bad_input():
    """A single cache's ``prefill`` / ``append``: bad rows, ``start``, ``committed`` or ring
    raise naming it, with nothing changed; then both work."""
    be = backends.get("emulated")
    s = SPECS["a"]
    c = s.config
    w, _ = built("a")
    kv = DraftKvCache(w, s.capacity, backend=be, rewind_slack=1)
    ring = FeatureRing(5, c.n_captured, c.hidden_size, backend=be)
    closed = FeatureRing(5, c.n_captured, c.hidden_size, backend=be)
    closed.close()
    wide = FeatureRing(5, c.n_captured + 1, c.hidden_size, backend=be)
    rows = np.random.default_rng(3).standard_normal((12, c.fc_in)).astype(np.float32)
    try:
        def state():
            return kv.next_pos, be.to_numpy(kv.slot_pos).tolist(), (ring.lo, ring.hi)
        before = state()
        with pytest.raises(RuntimeError, match="ring is closed"):
            kv.prefill(closed, rows)
        with pytest.raises(ValueError, match="fc_in"):
            kv.prefill(wide, rows)
        with pytest.raises(TypeError, match="ring must be a FeatureRing"):
            kv.append(rows, 3)
        with pytest.raises(TypeError, match="rows: expected a float array"):
            kv.prefill(ring, rows.astype(np.complex64))
        with pytest.raises(ValueError, match="start=-1"):
            kv.prefill(ring, rows, start=-1)
        with pytest.raises(ValueError, match="committed=0"):
            kv.append(ring, 0)
        with pytest.raises(KeyError, match=r"missing \[0, 3\)"):
            kv.append(ring, 3)
        assert state() == before
        kv.prefill(ring, rows)
        ring.write(12, rows[:3])
        kv.append(ring, 15)
        assert kv.next_pos == 15 and (ring.lo, ring.hi) == (10, 15)
        sp = be.to_numpy(kv.slot_pos)
        assert sorted(sp[sp >= 0].tolist()) == list(range(15))
    finally:
        for x in (kv, ring, wide):
            x.close()

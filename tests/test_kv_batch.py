"""DraftKvBatch (lanes): N lanes driven by independent schedules equal N
independent single-lane DraftKvCaches on the same schedules, bit for bit, and
each lane equals the float64 oracle (through its twin's checks).

Bit for bit because every kernel computes a row from that row alone, in an
order that does not depend on how many rows share the launch: the GEMMs'
M-tile variants and row blocks change which block computes a row, not the
order of its dot product (split K is decided by the column count and K, and
its slices are summed in a fixed order); the attention of a lane reads only
that lane's ring and masks. A change that breaks this shows here first.

Each lane has a twin: a ``Driver`` of tests/support/drafters.py (its own
DraftKvCache and FeatureRing, checked against the oracle every step); the
twin's ring writes are mirrored into the lane's ring, its noise into the
lane's noise rows."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dflash_cupy import backends
from dflash_cupy.emu.guarded_memory import live_serials
from dflash_cupy.kv_batch import DraftKvBatch
from dflash_cupy.ops.sample import SamplingParams
from tests.support.drafters import SPECS, built
from tests.support.lanes import IDLE, make, play


@pytest.mark.parametrize("name,x_split", [("a", True), ("b", True), ("c", True), ("b", False), ("c", False),
                                          ("g", True)])
def test_lanes_join_leave_rewind_reset(name, x_split):
    """Growth, idle lanes, a lane joining late (bulk prefill), a rewind, a
    jump, a reset: every active lane equals its twin bit for bit (with one
    rounding of the GEMM inputs, x_split=False, on both sides too)."""
    be, batch, twins = make(name, 3, x_split=x_split)
    assert batch.x_split is x_split and batch.g_gate_up.x_split is x_split
    schedule = [
        [5, IDLE, 30],
        [9, 3, 31],
        [IDLE, 6, 33],
        [12, ("rewind", 4), 20],      # lane 2 rewinds to 20 in one step (no rewind op needed: c < next_pos)
        [14, IDLE, ("rewind", 18)],
        [("reset", 7), 9, 60],        # lane 2 jumps far ahead (a bulk append past the window)
        [IDLE, IDLE, IDLE],           # nothing to do: every lane idle
        [8, 11, 61],
    ]
    for k, ops in enumerate(schedule):
        play(be, batch, twins, ops, eager=(k == 2))
    assert batch.captures == 2


# no shrinking: a failing example is printed as drawn (shrinking steps this slow takes many minutes)
@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_lanes_property_random_schedules(data):
    """Independent random schedules per lane (growth by 1..q_len+ accepted,
    idle steps, rewinds, jumps, resets) equal independent single caches."""
    name = data.draw(st.sampled_from(["a", "b", "c"]))
    lanes = data.draw(st.integers(1, 4))
    be, batch, twins = make(name, lanes)
    q = batch.q_len
    cur = [0] * lanes
    for _ in range(data.draw(st.integers(3, 6))):
        ops = []
        for i in range(lanes):
            kind = data.draw(st.sampled_from(["grow", "grow", "grow", "idle", "rewind", "jump", "reset"]))
            if kind == "idle" or (kind == "rewind" and cur[i] <= 1):
                ops.append(IDLE)
                continue
            if kind == "grow" or cur[i] == 0:
                c = cur[i] + data.draw(st.integers(1, q + 1))
                ops.append(c)
            elif kind == "rewind":
                c = data.draw(st.integers(1, cur[i] - 1))
                ops.append(("rewind", c))
            elif kind == "jump":
                c = cur[i] + data.draw(st.integers(batch.a_step + 1, batch.a_step + 1 + 2 * batch.capacity))
                ops.append(c)
            else:
                c = data.draw(st.integers(1, 2 * batch.capacity))
                ops.append(("reset", c))
            cur[i] = c
        play(be, batch, twins, ops)
    assert batch.captures <= 2


def test_sampled_lanes_equal_single_caches():
    """DFlash v1 drafters sample from the logits per lane (its temperature, top-k, top-p and
    seed; counter = its committed count): each lane's draft tokens equal its twin single cache
    built with the same SamplingParams bit for bit, over idle steps, a rewind and a reset, with
    one SamplingParams for every lane set between steps (no recapture)."""
    sps = [SamplingParams(temperature=1.2, top_p=0.9, seed=3), SamplingParams(temperature=0.7, top_k=5, seed=2**64 - 1),
           SamplingParams(temperature=1.2, top_p=0.9, seed=3)]
    be, batch, twins = make("a", 3, sampling=sps)
    for t, sp in zip(twins, sps):
        t.kv.set_sampling(sp)
    not_argmax = 0

    def steps(schedule):
        nonlocal not_argmax
        for ops in schedule:
            c_all = play(be, batch, twins, ops)     # tokens and logits lane vs twin, bit for bit
            toks, logits = be.to_numpy(batch.draft_tokens), be.to_numpy(batch.logits)
            live = [i for i, c in enumerate(c_all) if c is not None]
            not_argmax += int((toks[live] != logits[live].argmax(-1)).sum())
    steps([[5, IDLE, 9], [9, 3, 12], [IDLE, ("rewind", 2), 13]])
    graphs = list(batch._graphs)
    one = SamplingParams(temperature=0.5, seed=9)
    batch.set_sampling(one)
    for t in twins:
        t.kv.set_sampling(one)
    assert batch.sampling == (one,) * 3
    steps([[("reset", 7), 6, 14], [8, 9, IDLE]])
    assert batch._graphs == graphs and batch.captures == 2
    assert not_argmax >= 5, not_argmax             # sampled, not greedy
    # temperature > 0 needs the logits (the fused argmax is greedy): refused, nothing changed
    s = SPECS["c"]
    w, lm = built("c")
    hot = SamplingParams(temperature=0.8)
    with pytest.raises(ValueError, match=r"^sampling\[0\] with temperature > 0 needs logits=True"):
        DraftKvBatch(w, s.capacity, 2, lm_head=lm, logits=False, sampling=[hot, SamplingParams()], backend=be)
    with DraftKvBatch(w, s.capacity, 2, lm_head=lm, logits=False, backend=be) as fused:
        with pytest.raises(ValueError, match=r"^sampling\[1\] with temperature > 0 needs logits=True"):
            fused.set_sampling([SamplingParams(), hot])
        assert fused.sampling == (SamplingParams(),) * 2
    batch.close()
    for t in twins:
        t.kv.close()


@pytest.mark.slow
def test_graph_reuse_hundreds_of_steps():
    """300 steps with lanes joining and leaving (idle, reset, rewind) capture
    the step graph exactly twice (one per descriptor buffer) and allocate
    nothing after the first steps (the same live device allocations)."""
    be = backends.get("emulated")
    s = SPECS["c"]
    w, lm = built("c")
    batch = DraftKvBatch(w, s.capacity, 4, ring_capacity=s.ring_capacity, ring_dtype=s.ring_dtype,
                         backend=be, bulk_chunk=s.bulk_chunk)
    rng = np.random.default_rng(3)
    cur = [0] * 4
    fc = batch.config.fc_in
    for step in range(300):
        c_all = []
        for i in range(4):
            r = rng.random()
            if r < 0.3:
                c_all.append(None)
                continue
            if r < 0.35:
                batch.reset(i)
                cur[i] = 0
            c = cur[i] + int(rng.integers(1, batch.q_len + 2))
            ring = batch.rings[i]
            lo = max(0, c - batch.capacity)
            start = ring.hi if ring.lo <= lo <= ring.hi else lo
            if start < c:
                ring.write(start, rng.standard_normal((c - start, fc)).astype(np.float32))
            c_all.append(c)
            cur[i] = c
        batch.step(c_all, rng.standard_normal((4, batch.q_len, batch.config.hidden_size)).astype(np.float32))
        live = [i for i, c in enumerate(c_all) if c is not None]
        if step % 50 == 0 and live:
            assert np.isfinite(be.to_numpy(batch.hidden_states)[live]).all()
        if step == 20:
            held = live_serials()
    batch.synchronize()
    assert batch.captures == 2
    assert live_serials() == held


def test_bad_input_names_the_lane_and_changes_nothing():
    be, batch, twins = make("a", 3)
    play(be, batch, twins, [5, 7, IDLE])
    before = (list(batch.next_pos), be.to_numpy(batch.slot_pos).copy(), batch.captures)
    with pytest.raises(ValueError, match=r"committed\[1\]"):
        batch.begin_step([5, -3, None])
    with pytest.raises(TypeError, match=r"committed\[2\]"):
        batch.begin_step([5, 7, 2.5])
    with pytest.raises(KeyError, match="lane 2"):
        batch.begin_step([5, 7, 40])    # lane 2's ring holds nothing
    with pytest.raises(ValueError, match="one per lane"):
        batch.begin_step([5, 7])
    with pytest.raises(ValueError, match="lane=3"):
        batch.reset(3)
    with pytest.raises(ValueError, match="noise_embed"):
        batch.set_noise_embed(np.zeros((2, batch.q_len, batch.config.hidden_size), np.float32))
    with pytest.raises(RuntimeError, match="begin_step"):
        batch.run()
    assert (list(batch.next_pos), batch.captures) == (before[0], before[2])
    assert np.array_equal(be.to_numpy(batch.slot_pos), before[1])
    play(be, batch, twins, [6, 8, IDLE])   # and it goes on as if nothing happened
    # a ring write after planning that replaces planned rows is caught at run
    batch.rings[1].write(8, np.zeros((1, batch.config.fc_in), np.float32))
    batch.begin_step([None, 9, None])
    batch.rings[1].write(0, np.zeros((1, batch.config.fc_in), np.float32))
    with pytest.raises(RuntimeError, match="lane 1"):
        batch.run()
    batch.close()
    with pytest.raises(RuntimeError, match="closed"):
        batch.begin_step([1, 1, 1])


def test_constructor_rejects_bad_arguments():
    be = backends.get("emulated")
    w, _ = built("a")
    with pytest.raises(ValueError, match="lanes"):
        DraftKvBatch(w, 23, 0, backend=be)
    with pytest.raises(TypeError, match="lanes"):
        DraftKvBatch(w, 23, 2.0, backend=be)
    with pytest.raises(ValueError, match="ring_capacity"):
        DraftKvBatch(w, 23, 2, ring_capacity=0, backend=be)
    with pytest.raises(ValueError, match="rewind_slack"):
        DraftKvBatch(w, 23, 2, rewind_slack=-1, backend=be)
    for bad in (1, "no", None):
        with pytest.raises(TypeError, match="x_split"):
            DraftKvBatch(w, 23, 2, backend=be, x_split=bad)


def test_batch_plan_equals_per_lane_plan():
    """The descriptors, next positions and plans of begin_step (``decide_lanes``, every lane in
    one pass) equal each lane planned on its own (``plan_step``, ``fill_step_descriptor``) with
    the context rows packed afterwards (``pack_context_rows``), over random schedules
    (rewinds, idle lanes, windows past capacity, sliding windows, bulk appends)."""
    from dflash_cupy.ops.step_descriptor import (DESC_ACTIVE, DESC_COMMITTED, DESC_LEN, fill_descriptor,
                                                 fill_step_descriptor, pack_context_rows, plan_step)
    be = backends.get("emulated")
    s = SPECS["a"]          # sliding layers: swa_lo differs from lo
    w, _ = built("a")
    lanes = 9
    b = DraftKvBatch(w, s.capacity, lanes, ring_capacity=s.ring_capacity, backend=be)
    for r in b.rings:
        r.lo, r.hi = 0, 10**6   # the host path only: claim every position
    b.engine._bulk_append = lambda lane, fields, stream: None   # (the device side is not what this test is about)
    rng = np.random.default_rng(5)
    cur = [0] * lanes
    nxt = [0] * lanes
    bulks = 0
    for step in range(60):
        c_all = []
        for i in range(lanes):
            r = rng.random()
            if r < 0.2 or cur[i] == 0 and r < 0.5:
                c_all.append(None)
                continue
            c = cur[i] + int(rng.integers(1, 8)) if r < 0.85 or cur[i] < 2 else int(rng.integers(1, cur[i]))
            if cur[i] == 0 or r > 0.97:
                c = int(rng.integers(1, 3 * b.a_step))   # sometimes past a_step: a bulk append
            c_all.append(c)
            cur[i] = c
        want = np.zeros((lanes, DESC_LEN), np.int32)
        plans = []
        for i, c in enumerate(c_all):
            f = None if c is None else plan_step(nxt[i], c, b.geom, w.config.swa_window)
            plans.append(f)
            if f is None:
                fill_descriptor(want[i], 0, 0, 0, 0, 0, active=False)
            else:
                fill_step_descriptor(want[i], f)
                bulks += f.bulk_count > 0
                nxt[i] = c
        pack_context_rows(want, b.a_step)
        b.begin_step(c_all)
        assert np.array_equal(b._plan_desc, want), (step, c_all)
        assert b.last_plan == plans
        act = want[:, DESC_ACTIVE] != 0   # what run() does to the host state, without replaying
        for i in np.flatnonzero(act):
            b.engine._next[i] = int(want[i, DESC_COMMITTED])
        b.engine._planned = False
        assert b.next_pos == nxt
    assert bulks > 3


def test_streams_rings_on_the_target_stream_steps_on_the_drafter_stream(monkeypatch):
    """The stream contract per lane: ring writes on the target's stream, steps
    on the drafter's, device noise produced on the drafter's stream: ordered by
    the library on the device (the emulator raises StreamOrderError on any
    unordered access); without the batch's ordering the same run raises."""
    from dflash_cupy.backends import StreamOrderError
    be, batch, twins = make("c", 3)
    target, drafter = be.stream(), be.stream()
    rng = np.random.default_rng(9)
    fc, H, q = batch.config.fc_in, batch.config.hidden_size, batch.q_len
    committed = [3, None, 5]
    written = [0, 0, 0]
    for k in range(6):
        with target:
            for i, c in enumerate(committed):
                if c is not None and c > written[i]:
                    batch.rings[i].write(written[i], rng.standard_normal((c - written[i], fc)).astype(np.float32))
                    written[i] = c
        with drafter:
            noise = be.asarray(np.zeros((3, q, H), np.float32))
            batch.step(committed, noise)
            be.to_numpy(batch.hidden_states)        # read on the drafter's stream: in order
        committed = [None if c is None and k < 2 else (c or 2) + 1 for c in committed]
    be.synchronize()
    private = be.stream()
    monkeypatch.setattr(batch.order, "order", lambda stream=None, after=(): private)
    with drafter:
        for i, c in enumerate(committed):
            if c > written[i]:
                batch.rings[i].write(written[i], rng.standard_normal((c - written[i], fc)).astype(np.float32))
        with pytest.raises(StreamOrderError):
            batch.step(committed, np.zeros((3, q, H), np.float32))
            be.to_numpy(batch.hidden_states)
    be.synchronize()


def test_run_waits_only_for_rings_written_since_the_last_step(monkeypatch):
    """Per step the host adds one device wait per ring written since the last
    step, not one per lane (lanes whose rings did not change cost nothing)."""
    be, batch, twins = make("c", 4)
    fc = batch.config.fc_in
    rng = np.random.default_rng(4)
    for i in range(4):
        batch.rings[i].write(0, rng.standard_normal((6, fc)).astype(np.float32))
    s = be.stream()
    noise = np.zeros((4, batch.q_len, batch.config.hidden_size), np.float32)
    waits = []
    cls = type(s)
    orig = cls.wait_event
    monkeypatch.setattr(cls, "wait_event", lambda self, ev: (waits.append(ev), orig(self, ev))[1])
    with s:
        batch.step([5, 5, 5, 5], noise)
        first = len(waits)
        waits.clear()
        batch.rings[2].write(6, rng.standard_normal((1, fc)).astype(np.float32))
        waits.clear()                        # (the ring's own ordering)
        batch.step([5, 5, 6, 5], noise)
        assert [w for w in waits if w is batch.rings[2].write_event] and \
            not [w for i in (0, 1, 3) for w in waits if w is batch.rings[i].write_event]
    assert first >= 4
    be.synchronize()


def test_host_noise_in_bf16_as_the_single_cache_takes_it():
    """DraftKvBatch.set_noise_embed takes the host dtypes DraftKvCache takes (f32, f16,
    bf16), converted to f32 alike; anything else is refused and changes nothing."""
    import ml_dtypes
    be, batch, _ = make("a", 2)
    try:
        shape = (batch.lanes, batch.q_len, batch.config.hidden_size)
        x = np.random.default_rng(4).standard_normal(shape).astype(ml_dtypes.bfloat16)
        batch.set_noise_embed(x)
        got = be.to_numpy(batch.noise_embed).reshape(batch.lanes, batch.lane_rows, -1)[:, :batch.q_len]
        np.testing.assert_array_equal(got, x.astype(np.float32))
        with pytest.raises(TypeError, match="noise_embed must be a float array"):
            batch.set_noise_embed(np.zeros(shape, np.int32))
        np.testing.assert_array_equal(
            be.to_numpy(batch.noise_embed).reshape(batch.lanes, batch.lane_rows, -1)[:, :batch.q_len], got)
    finally:
        batch.close()


def test_gate_up_reads_sixteen_bit_norm_rows(monkeypatch):
    """x_split=False with many noise rows (``step_recipe.GATE_UP_X16_MIN_ROWS``, lowered here
    so a small batch takes it): the post-attention norm is its own launch writing 16-bit rows
    (``hn16``) and the gate_up GEMM reads them (x16, no folded norm). Every active lane still
    equals its twin bit for bit (the twin takes the same path) and each twin its oracle at the
    x_split=False tolerance; below the threshold the norm stays folded."""
    import dflash_cupy.step_recipe as si
    be, batch, twins = make("b", 2, x_split=False)
    assert batch.hn16 is None and batch.rms16 is None and not batch.g_gate_up.x16   # 2 lanes: folded
    monkeypatch.setattr(si, "GATE_UP_X16_MIN_ROWS", batch.n_noise + 1)
    be, batch, twins = make("b", 2, x_split=False)
    assert batch.hn16 is None
    monkeypatch.setattr(si, "GATE_UP_X16_MIN_ROWS", 1)
    be, batch, twins = make("b", 2, x_split=False)
    assert batch.hn16 is not None and batch.g_gate_up.x16 and batch.g_gate_up.norm_eps is None
    assert batch.hn16.dtype == batch.g_gate_up.x_dtype and batch.rms16.out_kind is not None
    assert all(t.kv.hn16 is not None and t.kv.g_gate_up.x16 for t in twins)
    for k, ops in enumerate([[5, 30], [9, IDLE], [12, ("rewind", 20)], [("reset", 7), 40]]):
        play(be, batch, twins, ops, eager=(k == 1))
    # x_split=True never stores the rows in 16 bits
    be, batch, twins = make("b", 2, x_split=True)
    assert batch.hn16 is None and not batch.g_gate_up.x16

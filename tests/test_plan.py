"""Device-side step planning (cuda_src/step_plan.cu, ring_slots.cu, the descriptor of
ops/step_descriptor.py; the unfused launches of tests/cuda/planning_unfused.cu): append rows and slot_pos
(SPEC §3 steps 1-4) against a NumPy simulation, feature gather, masks exactly
equal to dflash_cupy.reference.ring_masks, all driven from one step
descriptor through a captured graph."""
import ml_dtypes
import numpy as np
import pytest

from dflash_cupy.geometry import RingGeometry
from dflash_cupy.mask_rule import MaskRule
from dflash_cupy.ops.gather import FeatureGather, gather_features_reference
from dflash_cupy.ops.ring_slots import plan_append_reference
from dflash_cupy.ops.step_descriptor import (DESC_LEN, DESC_RESET, bulk_chunks, fill_chunk_descriptor,
                                             fill_descriptor, fill_step_descriptor, pack_context_rows, plan_step)
from dflash_cupy.reference import ring_masks
from tests.support.planning_unfused import UnfusedPlanning


class RingSim:
    """SPEC §3 steps 1-4 transcribed directly (independent of ops.step_descriptor.plan_step)."""

    def __init__(self, geom, chunk):
        self.g, self.chunk = geom, chunk
        self.next_pos = 0
        self.slot_pos = np.full(geom.capacity, -1, np.int32)

    def begin_step(self, committed):
        g = self.g
        if self.next_pos > committed:
            self.next_pos = 0
            self.slot_pos[:] = -1
        win = min(committed, g.capacity)
        lo = committed - win
        start = max(self.next_pos, lo)
        n_new = committed - start
        chunks = []
        if n_new > g.a_step:
            s, n = start, n_new
            while n > 0:
                c = min(n, self.chunk)
                pos = np.arange(s, s + c, dtype=np.int32)
                chunks.append((pos, (pos % g.capacity).astype(np.int32)))
                self.slot_pos[pos % g.capacity] = pos
                s, n = s + c, n - c
            start, n_new = committed, 0
        ap_pos = np.zeros(g.a_step, np.int32)
        ap_rows = np.full(g.a_step, g.trash_slot, np.int32)
        for i in range(n_new):
            p = start + i
            ap_pos[i], ap_rows[i] = p, p % g.capacity
            self.slot_pos[p % g.capacity] = p
        self.next_pos = committed
        return dict(start=start, n_new=n_new, ap_pos=ap_pos, ap_rows=ap_rows, chunks=chunks,
                    pos_q=(committed + np.arange(g.q_len)).astype(np.int32))


def bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


class DeviceRing:
    """The planning part of a step, the way the step engine drives one lane: bulk chunks
    outside the graph, then one captured graph (descriptor copy, reset_slots_if,
    plan_append, gather_features, build_masks; or with ``fused`` the one plan_lanes launch
    that does all four, over the engine's lane layout) replayed every step."""

    def __init__(self, be, geom, swa, ring_host, chunk, fused=False):
        self.be, self.g, self.swa, self.chunk, self.fused = be, geom, swa, chunk, fused
        ring_cap, fc_in = ring_host.shape
        A, Q = geom.a_step, geom.q_len
        cs, bs = -(-A // 16) * 16, -(-Q // 16) * 16
        self.planner = UnfusedPlanning(be, geom)
        self.gather = FeatureGather(be, fc_in, ring_cap, ring_host.dtype)
        self.ring3 = be.asarray(ring_host[None])   # [lanes = 1, ring_cap, fc_in]
        self.ring = self.ring3[0]
        self.next_pos = 0
        self.slot_all = be.zeros((1, geom.capacity), np.int32)
        self.slot_pos = self.slot_all[0]
        self.planner.reset_slots(self.slot_pos)
        self.desc_all = be.zeros((1, DESC_LEN), np.int32)
        self.desc_h = be.pinned_empty((1, DESC_LEN), np.int32)
        self.desc = self.desc_all[0]
        self.chunk_desc = be.zeros((DESC_LEN,), np.int32)
        self.chunk_desc_h = be.pinned_empty((DESC_LEN,), np.int32)
        # the engine's step rows: A context rows (padded to cs), then the q_len noise rows at cs
        self.pos_all, self.rows_all = be.zeros((cs + bs,), np.int32), be.zeros((cs + bs,), np.int32)
        self.tiles = be.zeros(((cs + bs) // 16,), np.int32)
        self.ap_pos, self.ap_rows, self.pos_q = self.pos_all[:A], self.rows_all[:A], self.pos_all[cs:cs + Q]
        self.ap_feat = be.asarray(np.full((cs, fc_in), np.nan, np.float32))
        self.bulk_pos = be.zeros((chunk,), np.int32)
        self.bulk_rows = be.zeros((chunk,), np.int32)
        self.bulk_feat = be.zeros((chunk, fc_in), np.float32)
        self.masks = be.zeros((2, 1, Q, geom.kv_total), np.float16)
        self.mask_full, self.mask_swa = self.masks[0, 0], self.masks[1, 0]
        s = self.stream = be.stream()
        be.synchronize()  # the zeros are memset on the default stream; the work runs on s
        fill_descriptor(self.desc_h[0], 1, 0, 0, 0, 0)
        self.gather.dense_pages(1, geom.kv_total)   # allocated before the capture
        be.begin_capture(s)
        be.copy_h2d_async(self.desc_all, self.desc_h, stream=s)
        if fused:   # the engine's step graph: one launch
            self.gather.plan_lanes(self.desc_all, self.ring3, self.ap_feat, geom, self.slot_all, self.pos_all,
                                   self.rows_all, self.tiles, cs=cs, bs=bs, mask_full=self.masks[0],
                                   mask_swa=self.masks[1], rule=swa, stream=s)
        else:
            self.planner.reset_slots_if(self.desc, self.slot_pos, stream=s)
            self.planner.plan_append(self.desc, self.ap_pos, self.ap_rows, self.slot_pos, self.pos_q, stream=s)
            self.gather(self.desc, self.ring, self.ap_feat[:A], stream=s)
            self.planner.build_masks(self.desc, self.slot_pos, self.mask_full, self.mask_swa, stream=s, rule=swa)
        self.graph = be.end_capture(s)

    def begin_step(self, committed):
        be = self.be
        f = plan_step(self.next_pos, committed, self.g, self.swa)
        chunks = []
        if f.bulk_count:
            if f.reset:
                self.planner.reset_slots(self.slot_pos, stream=self.stream)
            for s, c in bulk_chunks(f.bulk_start, f.bulk_count, self.chunk):
                fill_chunk_descriptor(self.chunk_desc_h, f, s, c)
                be.copy_h2d_async(self.chunk_desc, self.chunk_desc_h, stream=self.stream)
                self.planner.plan_append(self.chunk_desc, self.bulk_pos, self.bulk_rows, self.slot_pos,
                                         n_rows=c, stream=self.stream)
                self.gather(self.chunk_desc, self.ring, self.bulk_feat, n_rows=c, stream=self.stream)
                st = self.stream  # read in order after the chunk, on its stream
                chunks.append((be.to_numpy(self.bulk_pos, st)[:c], be.to_numpy(self.bulk_rows, st)[:c],
                               be.to_numpy(self.bulk_feat, st)[:c], self.chunk_desc_h.copy()))
        fill_step_descriptor(self.desc_h[0], f)
        pack_context_rows(self.desc_h, self.g.a_step)
        self.graph.launch(self.stream)
        be.synchronize()   # the pinned descriptor is rewritten next step
        self.next_pos = committed
        return f, chunks


def step_sequence(rng, geom, n):
    """Growth by 0..q_len, jumps past a_step, rewinds, far-away restarts."""
    c = int(rng.integers(1, 4))
    out = [c]
    for _ in range(n):
        r = rng.random()
        if r < 0.6:
            c += int(rng.integers(0, geom.q_len + 1))
        elif r < 0.75:
            c += int(rng.integers(geom.a_step + 1, geom.a_step + 2 * geom.capacity + 3))
        elif r < 0.88:
            c = max(1, c - int(rng.integers(1, 2 * geom.capacity + 3)))
        else:
            c = int(rng.integers(2**20, 2**30))
        out.append(c)
    return out


@pytest.mark.parametrize("capacity,q_len,swa,chunk", [(7, 4, 3, 1024), (3, 16, 1, 1024),
                                                      (33, 5, 0, 1024), (64, 16, 40, 1024),
                                                      (40, 2, 0, 9)])
@pytest.mark.parametrize("fused", [False, True])
def test_step_sequence_matches_simulation(backend, rng, capacity, q_len, swa, chunk, fused):
    geom = RingGeometry(capacity, q_len)
    fc_in = 19
    ring_cap = capacity + 3 * geom.a_step + 5
    ring = rng.standard_normal((ring_cap, fc_in)).astype(np.float16)
    dev = DeviceRing(backend, geom, swa, ring, chunk, fused)
    sim = RingSim(geom, chunk)
    ring32 = ring.astype(np.float32)
    for step, committed in enumerate(step_sequence(rng, geom, 30)):
        what = f"step {step} committed={committed}"
        exp = sim.begin_step(committed)
        f, chunks = dev.begin_step(committed)
        assert (f.start, f.n_new) == (exp["start"], exp["n_new"]), what
        assert len(chunks) == len(exp["chunks"]), what
        for (gp, gr, gfeat, cdesc), (ep, er) in zip(chunks, exp["chunks"]):
            assert np.array_equal(gp, ep) and np.array_equal(gr, er), f"{what}: bulk chunk rows"
            assert np.array_equal(gfeat, ring32[ep % ring_cap]), f"{what}: bulk chunk features"
            assert cdesc[DESC_RESET] == 0
        be = backend
        assert np.array_equal(be.to_numpy(dev.ap_pos), exp["ap_pos"]), f"{what}: ap_pos"
        assert np.array_equal(be.to_numpy(dev.ap_rows), exp["ap_rows"]), f"{what}: ap_rows"
        assert np.array_equal(be.to_numpy(dev.pos_q), exp["pos_q"]), f"{what}: pos_q"
        assert np.array_equal(be.to_numpy(dev.slot_pos), sim.slot_pos), f"{what}: slot_pos"
        feat_ref = np.zeros((geom.a_step, fc_in), np.float32)
        feat_ref[:exp["n_new"]] = ring32[exp["ap_pos"][:exp["n_new"]] % ring_cap]
        # (the fused launch writes the appended rows only: the rest stay as they were, stale
        # but finite after the first step, and reach only padding rows)
        n = exp["n_new"] if fused else geom.a_step
        assert np.array_equal(be.to_numpy(dev.ap_feat)[:n], feat_ref[:n]), f"{what}: ap_feat"
        mf, ms = ring_masks(sim.slot_pos, committed, geom, swa)
        assert np.array_equal(bits(be.to_numpy(dev.mask_full)), bits(mf)), f"{what}: mask_full"
        assert np.array_equal(bits(be.to_numpy(dev.mask_swa)), bits(ms)), f"{what}: mask_swa"


# (capacity, q_len, rewind_slack): with a slack the ring has capacity + slack slots, and after
# a rewind within it slots hold positions >= committed (hidden) next to the window's
MASK_GEOMS = [(1, 1, 0), (3, 16, 0), (7, 4, 0), (33, 5, 0), (100, 16, 0), (31, 1, 0),
              (1, 1, 3), (3, 16, 19), (19, 3, 1), (33, 5, 33)]


@pytest.mark.parametrize("capacity,q_len,slack", MASK_GEOMS)
def test_masks_exact(backend, rng, capacity, q_len, slack):
    """Arbitrary slot_pos (empty, stale, in/out of both windows, stale positions up to
    ``slack`` past committed) for many (committed, swa_window): bit-exact against
    ring_masks, all three entry points."""
    be = backend
    geom = RingGeometry(capacity, q_len, slack)
    slots = geom.slots
    planner = UnfusedPlanning(be, geom)
    shape = (q_len, geom.kv_total)
    mf_d, ms_d = be.zeros(shape, np.float16), be.zeros(shape, np.float16)
    one = be.zeros(shape, np.float16)
    desc_h = np.zeros(DESC_LEN, np.int32)
    for committed in (1, 2, capacity - 1, capacity, capacity + 1, 5 * capacity + 3, 2**20 + 17,
                      2**31 - 1 - q_len):
        if committed < 1:
            continue
        for swa in sorted({0, 1, 3, capacity - 1, capacity, capacity + 5}):
            if swa < 0:
                continue
            span = slots + 8
            sp = rng.integers(max(-1, committed - span), committed + 4 + slack, slots).astype(np.int32)
            sp[rng.random(slots) < 0.2] = -1
            f = plan_step(committed, committed, geom, swa)
            fill_step_descriptor(desc_h, f)
            desc, sp_d = be.asarray(desc_h), be.asarray(sp)
            # the per-row rule (default), the seed's anchored one, and is_causal's two values
            for rule in (MaskRule(swa), MaskRule(swa, per_row=False),
                         MaskRule(swa, causal_full=True, causal_sliding=True),
                         MaskRule(swa, causal_sliding=False)):
                planner.build_masks(desc, sp_d, mf_d, ms_d, rule=rule)
                ref_f, ref_s = ring_masks(sp, committed, geom, rule)
                what = f"committed={committed} {rule}"
                assert np.array_equal(bits(be.to_numpy(mf_d)), bits(ref_f)), f"{what}: mask_full"
                assert np.array_equal(bits(be.to_numpy(ms_d)), bits(ref_s)), f"{what}: mask_swa"
            planner.build_masks(desc, sp_d, mask_full=one, rule=rule)
            assert np.array_equal(bits(be.to_numpy(one)), bits(ref_f)), f"{what}: full only"
            planner.build_masks(desc, sp_d, mask_swa=one, rule=rule)
            assert np.array_equal(bits(be.to_numpy(one)), bits(ref_s)), f"{what}: swa only"


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("fc_in", [1, 19, 1100])
def test_gather_wraparound(backend, rng, dtype, fc_in):
    be = backend
    ring_cap, a_rows = 11, 9
    x = (rng.standard_normal((ring_cap, fc_in)) * 100).astype(np.float32)
    host = {"f32": x, "f16": x.astype(np.float16),
            "bf16": x.astype(ml_dtypes.bfloat16).view(np.uint16)}[dtype]
    g = FeatureGather(be, fc_in, ring_cap, host.dtype)
    ring = be.asarray(host)
    out = be.asarray(np.full((a_rows + 2, fc_in), np.nan, np.float32))
    desc_h = np.zeros(DESC_LEN, np.int32)
    for start, n_new in ((0, 9), (7, 6), (2**20 + 5, 3), (10, 0), (2**31 - 5, 4)):
        fill_descriptor(desc_h, start + n_new, 0, start, n_new, 0)
        g(be.asarray(desc_h), ring, out, n_rows=a_rows)
        got = be.to_numpy(out)
        ref = gather_features_reference(desc_h, host, a_rows)
        assert np.array_equal(got[:a_rows], ref), f"start={start} n_new={n_new}"
        assert np.isnan(got[a_rows:]).all(), "rows beyond n_rows were written"
    if dtype == "bf16":   # the reference decodes bf16 itself: check it once against ml_dtypes
        assert np.array_equal(ref[:4], host[(2**31 - 5 + np.arange(4)) % ring_cap]
                              .view(ml_dtypes.bfloat16).astype(np.float32))


def test_plan_append_reference_and_reset_if(backend, rng):
    be = backend
    geom = RingGeometry(10, 3)
    planner = UnfusedPlanning(be, geom)
    sp0 = rng.integers(-1, 50, 10).astype(np.int32)
    desc_h = np.zeros(DESC_LEN, np.int32)
    for start, n_new, n_rows, noise in ((5, 4, 8, True), (18, 8, 8, False), (2**30, 1, 3, True)):
        fill_descriptor(desc_h, start + n_new, max(0, start + n_new - 10), start, n_new, 0)
        sp = be.asarray(sp0)
        ap_pos, ap_rows = be.zeros((n_rows + 1,), np.int32), be.zeros((n_rows + 1,), np.int32)
        pos_q = be.zeros((3,), np.int32) if noise else None
        planner.plan_append(be.asarray(desc_h), ap_pos, ap_rows, sp, pos_q, n_rows=n_rows)
        e_pos, e_rows, e_sp, e_q = plan_append_reference(desc_h, sp0, n_rows, geom, noise)
        assert np.array_equal(be.to_numpy(ap_pos)[:n_rows], e_pos)
        assert np.array_equal(be.to_numpy(ap_rows)[:n_rows], e_rows)
        assert be.to_numpy(ap_rows)[n_rows] == 0, "entry beyond n_rows was written"
        assert np.array_equal(be.to_numpy(sp), e_sp)
        if noise:
            assert np.array_equal(be.to_numpy(pos_q), e_q)
    sp = be.asarray(sp0)
    for flag in (0, 1):
        fill_descriptor(desc_h, 5, 0, 0, 0, 0, reset=bool(flag))
        planner.reset_slots_if(be.asarray(desc_h), sp)
        assert np.array_equal(be.to_numpy(sp), np.full(10, -1, np.int32) if flag else sp0)


def test_plan_append_through_a_page_table(backend, rng):
    """The bulk path's rows through a shuffled page table of 64-row pages (ring slots on two
    pages, the trash slot on the third), and the reference's."""
    from dflash_cupy.ops.ring_slots import RingSlots
    be = backend
    geom = RingGeometry(100, 16)   # kv_total 128: pages 0, 1 (slots, noise, trash)
    slots = RingSlots(be, geom, page=64)
    table = np.array([7 * 64, 3 * 64], np.int32)
    desc_h = np.zeros(DESC_LEN, np.int32)
    sp0 = np.full(100, -1, np.int32)
    for start, n_new, n_rows in ((0, 70, 72), (150, 40, 40), (250, 3, 9)):
        fill_descriptor(desc_h, start + n_new, 0, start, n_new, 0)
        sp = be.asarray(sp0)
        ap_pos, ap_rows = be.zeros((n_rows,), np.int32), be.zeros((n_rows,), np.int32)
        slots.plan_append(be.asarray(desc_h), ap_pos, ap_rows, sp, n_rows=n_rows, pages=be.asarray(table))
        e_pos, e_rows, e_sp, _ = plan_append_reference(desc_h, sp0, n_rows, geom, False, pages=table, page=64)
        s = (start + np.arange(min(n_new, n_rows))) % 100
        want = np.where(s < 64, 7 * 64 + s, 3 * 64 + s - 64)
        assert np.array_equal(e_rows[:len(s)], want)
        assert (e_rows[len(s):] == 3 * 64 + geom.trash_slot - 64).all()
        assert np.array_equal(be.to_numpy(ap_rows), e_rows)
        assert np.array_equal(be.to_numpy(ap_pos), e_pos) and np.array_equal(be.to_numpy(sp), e_sp)
    with pytest.raises(ValueError, match=r"pages must have shape \(2,\)"):
        slots.plan_append(be.asarray(desc_h), ap_pos, ap_rows, sp, pages=be.zeros((3,), np.int32))


def test_plan_step_host_fields():
    g = RingGeometry(8, 2)   # a_step 6
    f = plan_step(0, 5, g, 3)
    assert (f.lo, f.start, f.n_new, f.swa_lo, f.reset, f.bulk_count) == (0, 0, 5, 2, False, 0)
    f = plan_step(5, 20, g, 0)            # 15 missing, window 8 -> bulk [12, 20)
    assert (f.lo, f.bulk_start, f.bulk_count, f.start, f.n_new, f.swa_lo) == (12, 12, 8, 20, 0, 12)
    f = plan_step(20, 4, g, 100)          # rewind, 4 rows fit the step: reset in the graph
    assert f.reset and f.bulk_count == 0 and (f.start, f.n_new) == (0, 4)
    buf = np.zeros(DESC_LEN, np.int32)
    assert fill_step_descriptor(buf, f)[DESC_RESET] == 1
    f = plan_step(30, 20, g, 0)           # rewind + bulk: the bulk path resets, not the graph
    assert f.reset and f.bulk_count == 8
    assert fill_step_descriptor(buf, f)[DESC_RESET] == 0
    assert bulk_chunks(3, 10, 4) == [(3, 4), (7, 4), (11, 2)]
    with pytest.raises(ValueError, match="committed"):
        plan_step(0, 0, g)
    with pytest.raises(TypeError, match="buf"):
        fill_descriptor(np.zeros(DESC_LEN, np.int64), 1, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="n_new"):
        fill_descriptor(buf, 1, 0, 0, -1, 0)


def test_bad_arguments_raise(emu):
    be = emu
    geom = RingGeometry(10, 3)
    planner = UnfusedPlanning(be, geom)
    desc = be.zeros((DESC_LEN,), np.int32)
    sp = be.zeros((10,), np.int32)
    with pytest.raises(ValueError, match="slot_pos"):
        planner.build_masks(desc, be.zeros((11,), np.int32), be.zeros((3, geom.kv_total), np.float16))
    with pytest.raises(ValueError, match="mask_swa"):
        planner.build_masks(desc, sp, mask_swa=be.zeros((3, geom.kv_total + 1), np.float16))
    with pytest.raises(TypeError, match="mask_full"):
        planner.build_masks(desc, sp, be.zeros((3, geom.kv_total), np.float32))
    with pytest.raises(ValueError, match="desc"):
        planner.reset_slots_if(be.zeros((3,), np.int32), sp)
    with pytest.raises(TypeError, match="ap_pos"):
        planner.plan_append(desc, be.zeros((8,), np.int64), be.zeros((8,), np.int32), sp)
    with pytest.raises(ValueError, match="pos_q"):
        planner.plan_append(desc, be.zeros((8,), np.int32), be.zeros((8,), np.int32), sp,
                            be.zeros((4,), np.int32))
    g = FeatureGather(be, 5, 4, "bf16")
    with pytest.raises(TypeError, match="ring"):
        g(desc, be.zeros((4, 5), np.float16), be.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="ap_feat"):
        g(desc, be.zeros((4, 5), np.uint16), be.zeros((2, 6), np.float32))


@pytest.mark.parametrize("capacity,q_len", [(10, 3), (3, 16), (37, 5)])
def test_plan_lanes_equals_the_four_launches(backend, rng, capacity, q_len):
    """step_plan.cu's plan_lanes for one lane (the step engine's planning launch) against
    reset_slots_if + plan_append + gather_features + build_masks on the same inputs: stale
    and empty slots, reset on and off, more new rows than a_step, starts that wrap the ring
    and sit near INT_MAX, one or both masks."""
    be = backend
    geom = RingGeometry(capacity, q_len)
    a_rows = geom.a_step
    cs, bs = -(-a_rows // 16) * 16, -(-q_len // 16) * 16
    planner = UnfusedPlanning(be, geom)
    fc_in, ring_cap = 19, 23
    ring_h = rng.standard_normal((ring_cap, fc_in)).astype(np.float16)
    g = FeatureGather(be, fc_in, ring_cap, ring_h.dtype)
    ring, ring3 = be.asarray(ring_h), be.asarray(ring_h[None])
    shape = (q_len, geom.kv_total)
    desc_h = np.zeros((1, DESC_LEN), np.int32)
    cases = [(5, 4, 0, False), (18, a_rows + 2, 2, True), (2**31 - 40, 3, 1, False), (0, 0, 0, True),
             (capacity * 7 + 1, min(a_rows, capacity), capacity // 2, False)]
    for (start, n_new, swa, reset), which in zip(cases, ("both", "full", "swa", "both", "both")):
        n_new = min(n_new, capacity)          # the host's invariant: appended rows hit distinct slots
        committed = start + n_new
        lo = max(0, committed - capacity)
        fill_descriptor(desc_h[0], committed, lo, start, n_new, max(lo, committed - swa), reset=reset)
        pack_context_rows(desc_h, a_rows)
        n_app = min(n_new, a_rows)
        sp0 = rng.integers(max(-1, committed - 2 * capacity), committed + 3, capacity).astype(np.int32)
        sp0[rng.random(capacity) < 0.3] = -1
        mf = {k: be.asarray(np.full((1,) + shape, 7, np.float16)) if which != "swa" else None for k in "uf"}
        ms = {k: be.asarray(np.full((1,) + shape, 7, np.float16)) if which != "full" else None for k in "uf"}
        # the four launches, on one lane's arrays
        d, sp = be.asarray(desc_h[0]), be.asarray(sp0)
        ap_pos, ap_rows = be.zeros((a_rows + 1,), np.int32), be.zeros((a_rows + 1,), np.int32)
        pos_q = be.zeros((q_len,), np.int32)
        feat = be.asarray(np.full((a_rows + 1, fc_in), np.nan, np.float32))
        planner.reset_slots_if(d, sp)
        planner.plan_append(d, ap_pos, ap_rows, sp, pos_q, n_rows=a_rows)
        g(d, ring, feat, n_rows=a_rows)
        m_u = [m["u"][0] if m["u"] is not None else None for m in (mf, ms)]
        planner.build_masks(d, sp, mask_full=m_u[0], mask_swa=m_u[1])
        unfused = [be.to_numpy(a) for a in (sp, ap_pos, ap_rows, pos_q)]
        # plan_lanes over the engine's lane layout
        sp_l = be.asarray(sp0[None])
        pos_all, rows_all = be.asarray(np.full(cs + bs, -7, np.int32)), be.asarray(np.full(cs + bs, -7, np.int32))
        tiles = be.zeros(((cs + bs) // 16,), np.int32)
        feat_l = be.asarray(np.full((cs, fc_in), np.nan, np.float32))
        g.plan_lanes(be.asarray(desc_h), ring3, feat_l, geom, sp_l, pos_all, rows_all, tiles, cs=cs, bs=bs,
                     mask_full=mf["f"], mask_swa=ms["f"])
        pa, ra = be.to_numpy(pos_all), be.to_numpy(rows_all)
        what = f"start={start} n_new={n_new} reset={reset} masks={which}"
        assert np.array_equal(be.to_numpy(sp_l)[0], unfused[0]), what
        assert np.array_equal(pa[:a_rows], unfused[1][:a_rows]) and np.array_equal(ra[:a_rows], unfused[2][:a_rows]), what
        assert np.array_equal(pa[cs:cs + q_len], unfused[3]), what
        assert np.array_equal(be.to_numpy(feat_l)[:n_app], be.to_numpy(feat)[:n_app]), what
        assert np.isnan(be.to_numpy(feat_l)[n_app:]).all(), f"{what}: gathered past the appended rows"
        for m in (mf, ms):
            if m["u"] is not None:
                assert np.array_equal(bits(be.to_numpy(m["f"])[0]), bits(be.to_numpy(m["u"])[0])), what
        assert list(be.to_numpy(tiles)) == [2 if 16 * t < n_app else 0 for t in range(cs // 16)] + [1] * (bs // 16)
        e_pos, e_rows, e_sp, e_q = plan_append_reference(desc_h[0], np.full(capacity, -1, np.int32) if reset
                                                         else sp0, a_rows, geom)
        assert np.array_equal(unfused[0], e_sp) and np.array_equal(unfused[1][:a_rows], e_pos), what
        assert unfused[1][a_rows] == 0 and np.isnan(be.to_numpy(feat)[a_rows]).all(), f"{what}: wrote past n_rows"

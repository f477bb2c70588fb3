"""step_plan.cu's plan_lanes (every lane of the step engine planned in one launch)
equals, bit for bit, the unfused planning launches (tests/cuda/planning_unfused.cu:
reset_slots_if, plan_append, gather_features, build_masks) run on each active lane's
slices, with cache rows offset by the lane and the appended context rows packed back
to back (DESC_CTX_ROW0 / DESC_CTX_ROWS), cache rows through the lanes' page tables
(shuffled, or the dense layout); idle lanes are left untouched (slot table, masks), and
the padding rows and tiles are dead."""
import numpy as np
import pytest

from dflash_cupy import backends
from dflash_cupy.geometry import RingGeometry, align_up
from dflash_cupy.kv_pages import dense_table, pages_per_lane, physical_rows
from dflash_cupy.mask_rule import MaskRule
from dflash_cupy.ops.gather import FeatureGather
from dflash_cupy.ops.step_descriptor import (DESC_ACTIVE, DESC_CTX_ROW0, DESC_CTX_ROWS, DESC_LEN, DESC_N_NEW,
                                             fill_descriptor, pack_context_rows)
from tests.support.planning_unfused import UnfusedPlanning


def _descs(rng, lanes, geom, ring_cap, idle):
    d = np.zeros((lanes, DESC_LEN), np.int32)
    for l in range(lanes):
        committed = int(rng.integers(1, 3 * geom.capacity)) + (2**31 - 4 * geom.capacity if l == 1 else 0)
        win = min(committed, geom.capacity)
        lo = committed - win
        n_new = int(rng.integers(0, min(geom.a_step, win) + 1))
        start = committed - n_new
        swa_lo = committed - min(win, 5)
        fill_descriptor(d[l], committed, lo, start, n_new, swa_lo, reset=bool(l == 2), active=l not in idle)
    pack_context_rows(d, geom.a_step)
    return d


@pytest.mark.parametrize("lanes,cap,q_len,fc_in,kind,idle,rule,slack,page", [
    (3, 19, 3, 19, "f16", {0}, MaskRule(5), 0, None),
    (4, 33, 5, 40, "bf16", {3}, MaskRule(3, causal_sliding=False, causal_full=True), 0, 32),
    (1, 7, 1, 8, "f32", set(), MaskRule(5, per_row=False), 0, 64),
    (3, 100, 16, 19, "f16", {1}, MaskRule(5), 0, 64),
    # rewind slack: slots = cap + slack (slot p % slots), the window stays cap
    (3, 3, 3, 19, "f16", {1}, MaskRule(5), 19, None),
    (2, 33, 5, 8, "f32", set(), MaskRule(3, per_row=False), 1, 32),
])
def test_plan_lanes_equals_the_unfused_launches_per_lane(lanes, cap, q_len, fc_in, kind, idle, rule, slack, page):
    """``page``: the rows through a shuffled page table over a shared pool (pages of the lanes
    interleaved, some unheld: the shared page 0); ``None``: the dense layout."""
    be = backends.get("emulated")
    rng = np.random.default_rng(1000 + lanes + slack)
    g = RingGeometry(cap, q_len, slack)
    cs, bs = align_up(g.a_step, 16), align_up(q_len, 16)
    ring_cap = cap + 3
    dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[kind]
    ring_h = (rng.standard_normal((lanes, ring_cap, fc_in)).astype(np.float32).astype(dt) if kind != "bf16" else
              rng.integers(0, 0x7f00, (lanes, ring_cap, fc_in)).astype(np.uint16))
    desc_h = _descs(rng, lanes, g, ring_cap, idle)
    slot0 = rng.integers(-1, 4 * g.slots, (lanes, g.slots)).astype(np.int32)
    mask0 = rng.standard_normal((lanes, q_len, g.kv_total)).astype(np.float16)
    rows = lanes * (cs + bs)
    sentinel_pos = np.full(rows, -7, np.int32)
    gather = FeatureGather(be, fc_in, ring_cap, dt if kind != "bf16" else "bf16")
    planner = UnfusedPlanning(be, g)

    # ---- all lanes at once
    desc, ring = be.asarray(desc_h), be.asarray(ring_h)
    ap_feat = be.asarray(np.full((lanes * cs, fc_in), 5.0, np.float32))
    slot_pos, mf, ms = be.asarray(slot0), be.asarray(mask0), be.asarray(mask0 + 1)
    pos_all, rows_all = be.asarray(sentinel_pos), be.asarray(sentinel_pos)
    tiles = be.asarray(np.full(rows // 16, -1, np.int32))
    if page is None:
        table, pg = dense_table(lanes, g.kv_total, 32), 32
        gather.plan_lanes(desc, ring, ap_feat, g, slot_pos, pos_all, rows_all, tiles, cs=cs, bs=bs,
                          mask_full=mf, mask_swa=ms, rule=rule)
    else:
        n = pages_per_lane(g.kv_total, page)
        table = ((1 + rng.permutation(lanes * n + 2)[:lanes * n]) * page).reshape(lanes, n).astype(np.int32)
        table[0, 0] = 0   # a page lane 0 does not hold: the shared page
        pg = page
        gather.plan_lanes(desc, ring, ap_feat, g, slot_pos, pos_all, rows_all, tiles, cs=cs, bs=bs,
                          mask_full=mf, mask_swa=ms, rule=rule, pages=be.asarray(table), page=page)
    phys = [physical_rows(table[l], pg, g.kv_total) for l in range(lanes)]
    got = {k: be.to_numpy(v) for k, v in dict(ap_feat=ap_feat, slot_pos=slot_pos, mf=mf, ms=ms, pos=pos_all,
                                              rows=rows_all, tiles=tiles).items()}

    total = int(desc_h[0, DESC_CTX_ROWS])
    assert total == sum(min(int(desc_h[l, DESC_N_NEW]), g.a_step) for l in range(lanes) if l not in idle)
    for l in range(lanes):
        noise = lanes * cs + l * bs
        if l in idle:
            assert np.array_equal(got["slot_pos"][l], slot0[l])
            assert np.array_equal(got["mf"][l], mask0[l]) and np.array_equal(got["ms"][l], mask0[l] + 1)
            assert not got["tiles"][noise // 16:(noise + bs) // 16].any()
            continue
        n_app = min(int(desc_h[l, DESC_N_NEW]), g.a_step)
        ctx = slice(int(desc_h[l, DESC_CTX_ROW0]), int(desc_h[l, DESC_CTX_ROW0]) + n_app)
        # the unfused launches on this lane's slices
        d1 = be.asarray(desc_h[l])
        af1 = be.asarray(np.full((g.a_step, fc_in), 5.0, np.float32))
        sp1 = be.asarray(slot0[l])
        mf1, ms1 = be.asarray(mask0[l]), be.asarray(mask0[l] + 1)
        ap_pos, ap_rows, pos_q = (be.zeros((g.a_step,), np.int32), be.zeros((g.a_step,), np.int32),
                                  be.zeros((q_len,), np.int32))
        planner.reset_slots_if(d1, sp1)
        planner.plan_append(d1, ap_pos, ap_rows, sp1, pos_q, n_rows=g.a_step)
        gather(d1, be.asarray(ring_h[l]), af1, n_rows=g.a_step)
        planner.build_masks(d1, sp1, mask_full=mf1, mask_swa=ms1, rule=rule)
        assert np.array_equal(got["ap_feat"][ctx], be.to_numpy(af1)[:n_app])
        assert np.array_equal(got["slot_pos"][l], be.to_numpy(sp1))
        assert np.array_equal(got["mf"][l].view(np.uint16), be.to_numpy(mf1).view(np.uint16))
        assert np.array_equal(got["ms"][l].view(np.uint16), be.to_numpy(ms1).view(np.uint16))
        assert np.array_equal(got["pos"][ctx], be.to_numpy(ap_pos)[:n_app])
        assert np.array_equal(got["rows"][ctx], phys[l][be.to_numpy(ap_rows)[:n_app]])
        assert np.array_equal(got["pos"][noise:noise + q_len], be.to_numpy(pos_q))
        assert (got["tiles"][noise // 16:(noise + bs) // 16] == 1).all()   # noise rows: every column
    # the packed context rows: live tiles exactly those holding one of them; the
    # rest is padding (position 0, the trash slot of the lane whose region it is in)
    # (2: context rows, which need only the K and V columns of the qkv GEMM)
    assert list(got["tiles"][:lanes * cs // 16]) == [2 if 16 * t < total else 0 for t in range(lanes * cs // 16)]
    r = np.arange(total, lanes * cs)
    assert (got["pos"][r] == 0).all()
    assert (got["rows"][r] == [phys[l][g.trash_slot] for l in r // cs]).all()
    assert (got["ap_feat"][total:] == 5.0).all()   # nothing gathered past the packed rows
    # noise rows (idle lanes' too: pages change between steps): the lane's noise scratch, padding
    # past q_len its trash slot; their positions past q_len are the host's (untouched here)
    for l in range(lanes):
        n0 = lanes * cs + l * bs
        j = np.arange(bs)
        assert (got["rows"][n0:n0 + bs] == phys[l][g.slots + np.minimum(j, q_len)]).all()
        assert (got["pos"][n0 + q_len:n0 + bs] == -7).all()
    assert desc_h[:, DESC_ACTIVE].sum() == lanes - len(idle)


def test_plan_lanes_rejects_bad_layout():
    be = backends.get("emulated")
    g = RingGeometry(7, 2)
    gather = FeatureGather(be, 8, 7, np.float32)
    desc = be.zeros((2, DESC_LEN), np.int32)
    ring = be.zeros((2, 7, 8), np.float32)
    cs, bs = 16, 16
    args = lambda **k: dict(dict(cs=cs, bs=bs, mask_full=be.zeros((2, 2, g.kv_total), np.float16)), **k)
    ap, sp = be.zeros((2 * cs, 8), np.float32), be.zeros((2, 7), np.int32)
    pa, ra, tl = be.zeros((64,), np.int32), be.zeros((64,), np.int32), be.zeros((4,), np.int32)
    with pytest.raises(ValueError, match="cs=8"):
        gather.plan_lanes(desc, ring, ap, g, sp, pa, ra, tl, **args(cs=8))
    with pytest.raises(ValueError, match="tile_live"):
        gather.plan_lanes(desc, ring, ap, g, sp, pa, ra, be.zeros((3,), np.int32), **args())
    with pytest.raises(ValueError, match="ring"):
        gather.plan_lanes(desc, be.zeros((3, 7, 8), np.float32), ap, g, sp, pa, ra, tl, **args())
    with pytest.raises(ValueError, match="mask_full and/or mask_swa"):
        gather.plan_lanes(desc, ring, ap, g, sp, pa, ra, tl, cs=cs, bs=bs)
    with pytest.raises(ValueError, match="slot_pos must have shape"):
        gather.plan_lanes(desc, ring, ap, g, be.zeros((2, 6), np.int32), pa, ra, tl, **args())
    with pytest.raises(ValueError, match="mask_swa must have shape"):
        gather.plan_lanes(desc, ring, ap, g, sp, pa, ra, tl, **args(mask_swa=be.zeros((2, 2, 5), np.float16)))
    m = be.zeros((2, 2, g.kv_total), np.float16)
    with pytest.raises(ValueError, match="must not overlap"):
        gather.plan_lanes(desc, ring, ap, g, sp, pa, ra, tl, **args(mask_full=m, mask_swa=m))
    with pytest.raises(TypeError, match="geom"):
        gather.plan_lanes(desc, ring, ap, (7, 2), sp, pa, ra, tl, **args())
    with pytest.raises(ValueError, match=r"pages must have shape \(2, 1\)"):
        gather.plan_lanes(desc, ring, ap, g, sp, pa, ra, tl, **args(pages=be.zeros((2, 2), np.int32)))
    with pytest.raises(ValueError, match="page_size=16"):
        gather.plan_lanes(desc, ring, ap, g, sp, pa, ra, tl, **args(pages=be.zeros((2, 1), np.int32), page=16))
